"""Throughput of the disttrain loop vs a plain DDP loop, and vs a plain FSDP2 loop, on the same model and data
(2 processes, gloo, CPU).

    python bench/loop_overhead.py [--steps 60] [--batch 1280] [--accum 1] [--case ddp|ordered|fsdp2|loader|all]

Runs itself under ``torch.distributed.run --nproc-per-node=2``. In the same processes it interleaves, step by
step, a plain DDP loop (batches sliced from a tensor by a random permutation; forward, backward, AdamW step) and
:class:`ElasticTrainer` on an identical model and the same data (global-cursor sampler, LR rule, boundary
agreement, metrics). Interleaving makes both see the same machine load, which matters on a shared 2-core box.
Each disttrain step is timed from asking the loop for the step to the end of the body, so everything the loop
does after the body (optimizer step, LR, boundary all-reduce, checkpoint decision) lands in the next step's time.
Prints the ratio of median step times as ``throughput_vs_plain_ddp``. The ordered case is the same against the
trainer with ``spec.training.gradientReduction: ordered`` (gradients summed in a fixed order of micro-batch index,
:mod:`disttrain.trainer.ordered_reduction`; its reduction runs before the optimizer step, so it lands in the next
step's time) and prints ``ordered_throughput_vs_plain_ddp``. ``--accum N`` splits each process's batch into N
micro batches (DDP's ``no_sync`` for all but the last in the plain loop). The FSDP2 case (its own torchrun) shards
each Linear and then the root in the hand-written loop (``fully_shard``, optimizer built afterwards) and runs
the trainer with ``parallelism="fsdp2"``, which picks the same units by default; it prints
``throughput_vs_plain_fsdp2``. The loader case reads a dataset whose ``__getitem__`` costs 1 ms (a sleep, as
for decoding or I/O) through 2 DataLoader workers per rank: a plain loop over ``DataLoader(DistributedSampler)``
against the trainer with ``num_workers=2``, in alternating blocks of steps (so both see the same load; their
workers would otherwise prefetch during each other's steps). It prints ``loader_samples_per_second_vs_plain``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from _torchrun import run_standalone

N_SAMPLES = 65536
WARMUP = 3
LOADER_ITEM_SECONDS = 0.001
LOADER_BLOCKS = 3


def model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 768),
        torch.nn.ReLU(),
        torch.nn.Linear(768, 10),
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N_SAMPLES, 256, generator=g)
    y = torch.randint(0, 10, (N_SAMPLES,), generator=g)
    return model, x, y


def plain_model(model: torch.nn.Module, case: str) -> torch.nn.Module:
    """The hand-written loop's model: DDP, or FSDP2 with each Linear and then the root as a unit."""
    if case == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    return model


class SlowDataset(torch.utils.data.Dataset):
    """Samples that cost ``LOADER_ITEM_SECONDS`` each to read, as decoding or remote I/O does."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        time.sleep(LOADER_ITEM_SECONDS)
        return self.x[i], self.y[i]


def loader_worker(args) -> None:
    from disttrain.trainer.loop import ElasticTrainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = args.loader_batch
    model, x, y = model_and_data()
    dataset = SlowDataset(x, y)
    plain = torch.nn.parallel.DistributedDataParallel(model)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, seed=0)
    plain_batches = iter(torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=2))

    ours_model, _, _ = model_and_data()
    ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=1e-3)
    tmp = tempfile.mkdtemp(prefix="loop-bench-")
    os.environ["DISTTRAIN_CONTRACT"] = json.dumps(
        {
            "training": {
                "globalBatchSize": batch * world,
                "microBatchSize": batch,
                "lr": {"base": 1e-3},
                "maxSteps": args.steps + 2 * LOADER_BLOCKS,
                "seed": 0,
            },
            "checkpoint": {"path": tmp, "intervalSteps": 1_000_000, "keep": 1},
        }
    )
    os.environ["DISTTRAIN_CHECKPOINT_DIR"] = tmp
    trainer = ElasticTrainer.from_env(ours_model, ours_opt, dataset, log_every=1_000_000, num_workers=2)
    steps = trainer.steps()

    def plain_step() -> None:
        xb, yb = next(plain_batches)
        torch.nn.functional.cross_entropy(plain(xb), yb).backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    def ours_step() -> None:
        step = next(steps)
        for mb in step:
            xb, yb = mb.data
            step.backward(torch.nn.functional.cross_entropy(trainer.model(xb), yb, reduction="sum"))

    plain_s = ours_s = 0.0
    per_block = max(1, args.steps // LOADER_BLOCKS)
    for _ in range(LOADER_BLOCKS):
        for run, total in ((plain_step, "plain"), (ours_step, "ours")):
            run()  # the first step of a block waits for the workers to fill the queue again: not measured
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(per_block):
                run()
            dist.barrier()
            if total == "plain":
                plain_s += time.perf_counter() - t0
            else:
                ours_s += time.perf_counter() - t0
    if rank == 0:
        n = per_block * LOADER_BLOCKS * batch * world
        print(f"plain DataLoader loop (2 workers, 1 ms per sample): {n / plain_s:.0f} samples/s", flush=True)
        print(f"disttrain loop (num_workers=2): {n / ours_s:.0f} samples/s", flush=True)
        print(f"loader_samples_per_second_vs_plain: {plain_s / ours_s:.3f}", flush=True)
    for _ in steps:
        pass
    trainer.close()


def worker(args) -> None:
    if args.case == "loader":
        loader_worker(args)
        return
    from disttrain.trainer.loop import ElasticTrainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, x, y = model_and_data()
    parallelism = "fsdp2" if args.case == "fsdp2" else "ddp"
    plain = plain_model(model, parallelism)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    perm = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(2))
    micro = args.batch // args.accum
    reduction = "ordered" if args.case == "ordered" else "ddp"

    ours_model, _, _ = model_and_data()
    ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=1e-3)
    tmp = tempfile.mkdtemp(prefix="loop-bench-")
    os.environ["DISTTRAIN_CONTRACT"] = json.dumps(
        {
            "training": {
                "globalBatchSize": args.batch * world,
                "microBatchSize": micro,
                "lr": {"base": 1e-3},
                "maxSteps": args.steps + 1,
                "seed": 0,
                "gradientReduction": reduction,
            },
            "checkpoint": {"path": tmp, "intervalSteps": 1_000_000, "keep": 1},
        }
    )
    os.environ["DISTTRAIN_CHECKPOINT_DIR"] = tmp
    trainer = ElasticTrainer.from_env(
        ours_model, ours_opt, torch.utils.data.TensorDataset(x, y), log_every=1_000_000, parallelism=parallelism
    )
    steps = trainer.steps()

    plain_s, ours_s = [], []
    for k in range(args.steps):
        t0 = time.perf_counter()
        idx = perm[(torch.arange(args.batch) + (k * world + rank) * args.batch) % N_SAMPLES]
        for a in range(args.accum):
            sub = idx[a * micro : (a + 1) * micro]
            sync = a == args.accum - 1 or parallelism != "ddp"
            with contextlib.nullcontext() if sync else plain.no_sync():
                torch.nn.functional.cross_entropy(plain(x[sub]), y[sub]).backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        step = next(steps)
        for mb in step:
            xb, yb = mb.data
            step.backward(torch.nn.functional.cross_entropy(trainer.model(xb), yb, reduction="sum"))
        t2 = time.perf_counter()
        if k >= WARMUP:
            plain_s.append(t1 - t0)
            ours_s.append(t2 - t1)
    if rank == 0:
        p, o = statistics.median(plain_s), statistics.median(ours_s)
        name, ours = parallelism.upper(), args.case.upper() if args.case == "ordered" else parallelism.upper()
        print(f"{args.accum} micro batch(es) of {micro} per process and step", flush=True)
        print(f"plain {name}: median step {p * 1000:.1f} ms ({args.batch * world / p:.0f} samples/s)", flush=True)
        print(
            f"disttrain loop ({ours}): median step {o * 1000:.1f} ms ({args.batch * world / o:.0f} samples/s)",
            flush=True,
        )
        prefix = "ordered_" if args.case == "ordered" else ""
        print(f"{prefix}throughput_vs_plain_{parallelism}: {p / o:.3f}", flush=True)
    for _ in steps:  # the last step ends the run (final checkpoint) outside the measurement
        pass
    trainer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=1280)
    parser.add_argument("--accum", type=int, default=1, help="micro batches per process and step (divides --batch)")
    parser.add_argument("--case", choices=["ddp", "ordered", "fsdp2", "loader", "all"], default="all")
    parser.add_argument("--loader-batch", type=int, default=32, help="per rank, in the loader case")
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    lines = []
    for case in ["ddp", "ordered", "fsdp2", "loader"] if args.case == "all" else [args.case]:
        worker_args = ["--steps", str(args.steps), "--batch", str(args.batch), "--loader-batch", str(args.loader_batch)]
        lines += run_standalone(__file__, [*worker_args, "--accum", str(args.accum), "--case", case])
    ratios = ("throughput_vs_", "ordered_throughput_vs_", "loader_samples_per_second_vs_")
    details = [ln for ln in lines if not ln.startswith(ratios)]
    print("\n".join(details + [ln for ln in lines if ln.startswith(ratios)]))


if __name__ == "__main__":
    main()
