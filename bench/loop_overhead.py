"""Throughput of the disttrain loop vs a plain DDP loop on the same model and data (2 processes, gloo, CPU).

    python bench/loop_overhead.py [--steps 60] [--batch 1280]

Runs itself under ``torch.distributed.run --nproc-per-node=2``. In the same processes it interleaves, step by
step, a plain DDP loop (batches sliced from a tensor by a random permutation; forward, backward, AdamW step) and
:class:`ElasticTrainer` on an identical model and the same data (global-cursor sampler, LR rule, boundary
agreement, metrics). Interleaving makes both see the same machine load, which matters on a shared 2-core box.
Each disttrain step is timed from asking the loop for the step to the end of the body, so everything the loop
does after the body (optimizer step, LR, boundary all-reduce, checkpoint decision) lands in the next step's time.
Prints the ratio of median step times as ``throughput_vs_plain_ddp``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

N_SAMPLES = 65536
WARMUP = 3


def model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 768),
                                torch.nn.ReLU(), torch.nn.Linear(768, 10))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N_SAMPLES, 256, generator=g)
    y = torch.randint(0, 10, (N_SAMPLES,), generator=g)
    return model, x, y


def worker(args) -> None:
    from disttrain.trainer.loop import ElasticTrainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, x, y = model_and_data()
    plain = torch.nn.parallel.DistributedDataParallel(model)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    perm = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(2))

    ours_model, _, _ = model_and_data()
    ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=1e-3)
    tmp = tempfile.mkdtemp(prefix="loop-bench-")
    os.environ["DISTTRAIN_CONTRACT"] = json.dumps({
        "training": {"globalBatchSize": args.batch * world, "microBatchSize": args.batch, "lr": {"base": 1e-3},
                     "maxSteps": args.steps + 1, "seed": 0},
        "checkpoint": {"path": tmp, "intervalSteps": 1_000_000, "keep": 1}})
    os.environ["DISTTRAIN_CHECKPOINT_DIR"] = tmp
    trainer = ElasticTrainer.from_env(ours_model, ours_opt, torch.utils.data.TensorDataset(x, y), log_every=1_000_000)
    steps = trainer.steps()

    plain_s, ours_s = [], []
    for k in range(args.steps):
        t0 = time.perf_counter()
        idx = perm[(torch.arange(args.batch) + (k * world + rank) * args.batch) % N_SAMPLES]
        torch.nn.functional.cross_entropy(plain(x[idx]), y[idx]).backward()
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
        print(f"plain DDP: median step {p * 1000:.1f} ms ({args.batch * world / p:.0f} samples/s)", flush=True)
        print(f"disttrain loop: median step {o * 1000:.1f} ms ({args.batch * world / o:.0f} samples/s)", flush=True)
        print(f"throughput_vs_plain_ddp: {p / o:.3f}", flush=True)
    for _ in steps:  # the last step ends the run (final checkpoint) outside the measurement
        pass
    trainer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=1280)
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           __file__, *sys.argv[1:]], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-5000:])
        raise SystemExit(proc.returncode)
    print("\n".join(ln for ln in proc.stdout.splitlines() if ln.strip()))


if __name__ == "__main__":
    main()
