"""Checkpoint throughput vs dd, and how long async saves block training (one process, gloo, CPU); then the same
save of FSDP2-sharded state from 2 processes.

    python bench/checkpoint_throughput.py [--state-mb 100] [--repeats 3] [--dir DIR] [--case single|fsdp2|all]

save_vs_dd_ratio: dd's time to write and fsync the same number of bytes to the same directory, divided by a
sync save's time through the real CheckpointManager (DCP write + fsync + digests + COMPLETE.json + renames),
medians of ``--repeats``, measured alternately in this run. async_blocking_fraction: the time an async save
blocks the training loop (kick-off plus waiting for the staging copy before the next optimizer step),
divided by the median step time of the same model without a save. fsdp2_save_vs_dd_ratio: the same ratio for a
model sharded with ``fully_shard`` over 2 processes (its own torchrun): each rank writes its shards of the
parameters and AdamW moments through the CheckpointManager; dd writes the total bytes from one process.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _torchrun import run_standalone

from disttrain.api.spec import CheckpointSpec
from disttrain.trainer.checkpoint import manager as ckpt_mod

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.manifests

from tests.manifests import bare_manifest


def build(state_mb: float, width: int = 1024) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    # AdamW keeps two moments: the state is ~3x the parameters.
    params = int(state_mb * 1e6 / 4 / 3)
    layers = max(1, round(params / (width * width)))
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(layers)]
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def train_step(model, opt, x, manager=None) -> None:
    model(x).square().mean().backward()
    if manager is not None:
        manager.before_optimizer_step()
    opt.step()
    opt.zero_grad(set_to_none=True)


def one_process_group(port: int) -> dist.ProcessGroup:
    """A gloo group of this process alone (on one intra-op thread), for the single-process saves."""
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    return dist.new_group(backend="gloo")


def dd_seconds(directory: Path, nbytes: int) -> float:
    target = directory / "dd.bin"
    block = 4 * 2**20
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", f"bs={block}", f"count={-(-nbytes // block)}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    seconds = time.perf_counter() - t0
    target.unlink()
    return seconds


def fsdp2_worker(args: argparse.Namespace) -> None:
    """One rank of the sharded case (started by :func:`main` under torchrun)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo")
    root = Path(args.root)
    model, _ = build(args.state_mb)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, opt, torch.randn(args.batch // world, 1024))
    state = {"app": ckpt_mod.ModelOptimState(model, opt), "trainer": ckpt_mod.TrainerState()}
    manager = ckpt_mod.CheckpointManager(root / "fsdp2", CheckpointSpec(keep=1), rank, world, group)
    manager.save(0, state, bare_manifest(0))  # warm-up
    save_s, dd_s = [], []
    for i in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        manager.save(i + 1, state, bare_manifest(i + 1))
        dist.barrier()
        save_s.append(time.perf_counter() - t0)
        manager.join_retention()
        if rank == 0:
            nbytes = sum(f.stat().st_size for f in (root / "fsdp2" / f"step-{i + 1}").iterdir())
            dd_s.append(dd_seconds(root, nbytes))
        dist.barrier()
    params = sum(p.numel() for p in get_model_state_dict(model).values())
    if rank == 0:
        mb = nbytes / 1e6
        save, dd = statistics.median(save_s), statistics.median(dd_s)
        print(
            f"fsdp2 ({world} ranks, {params / 1e6:.1f}M parameters): {mb:.1f} MB; sync save median {save:.3f} s "
            f"({mb / save:.0f} MB/s); dd conv=fsync median {dd:.3f} s ({mb / dd:.0f} MB/s)"
        )
        print(f"fsdp2_save_vs_dd_ratio: {dd / save:.2f}")
    manager.close()
    dist.destroy_process_group()


def run_fsdp2_case(args: argparse.Namespace) -> list[str]:
    """The sharded case under torchrun; returns its output lines."""
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-fsdp2-", dir=args.dir))
    try:
        worker_args = ["--state-mb", str(args.state_mb), "--repeats", str(args.repeats), "--batch", str(args.batch)]
        return run_standalone(__file__, [*worker_args, "--case", "fsdp2", "--root", str(root)])
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mb", type=float, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--case", choices=["single", "fsdp2", "all"], default="all")
    parser.add_argument("--root", default=None, help=argparse.SUPPRESS)  # the fsdp2 workers' directory
    args = parser.parse_args()
    if "RANK" in os.environ:
        fsdp2_worker(args)
        return
    fsdp2_lines = run_fsdp2_case(args) if args.case in ("fsdp2", "all") else []
    if args.case == "fsdp2":
        print("\n".join(fsdp2_lines))
        return
    group = one_process_group(29561)
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    try:
        model, opt = build(args.state_mb)
        x = torch.randn(args.batch, 1024)
        train_step(model, opt, x)  # materialise the optimizer state
        state = {"app": ckpt_mod.ModelOptimState(model, opt), "trainer": ckpt_mod.TrainerState()}

        sync = ckpt_mod.CheckpointManager(root / "sync", CheckpointSpec(keep=1), 0, 1, group)
        sync.save(0, state, bare_manifest(0))  # warm-up: DCP caches its plan after the first save
        save_s, dd_s, nbytes = [], [], 0
        for i in range(args.repeats):
            t0 = time.perf_counter()
            sync.save(i + 1, state, bare_manifest(i + 1))
            save_s.append(time.perf_counter() - t0)
            sync.join_retention()
            nbytes = sum(f.stat().st_size for f in (root / "sync" / f"step-{i + 1}").iterdir())
            dd_s.append(dd_seconds(root, nbytes))

        step_s = []
        for _ in range(5):
            t0 = time.perf_counter()
            train_step(model, opt, x)
            step_s.append(time.perf_counter() - t0)
        step = statistics.median(step_s)
        blocked = []
        async_mgr = ckpt_mod.CheckpointManager(root / "async", CheckpointSpec(keep=1, async_save=True), 0, 1, group)
        for i in range(args.repeats):
            before = async_mgr.blocked_s
            async_mgr.save(i + 1, state, bare_manifest(i + 1))
            train_step(model, opt, x, async_mgr)  # the next step overlaps the staging copy
            blocked.append(async_mgr.blocked_s - before)
            while async_mgr.local_pending_state()[0]:
                train_step(model, opt, x, async_mgr)
            async_mgr.poll(all_done=True)
        async_mgr.close()

        mb = nbytes / 1e6
        save, dd = statistics.median(save_s), statistics.median(dd_s)
        print(f"state: {mb:.1f} MB in {root}")
        print(
            f"sync save: median {save:.3f} s ({mb / save:.0f} MB/s); dd conv=fsync: median {dd:.3f} s "
            f"({mb / dd:.0f} MB/s)"
        )
        print(
            f"step: median {step * 1000:.1f} ms; async save blocked: median {statistics.median(blocked) * 1000:.1f}"
            f" ms (all: {', '.join(f'{b * 1000:.1f}' for b in blocked)})"
        )
        for line in fsdp2_lines:
            if not line.startswith("fsdp2_"):
                print(line)
        print(f"save_vs_dd_ratio: {dd / save:.2f}")
        print(f"async_blocking_fraction: {statistics.median(blocked) / step:.3f}")
        print("\n".join(ln for ln in fsdp2_lines if ln.startswith("fsdp2_")))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
