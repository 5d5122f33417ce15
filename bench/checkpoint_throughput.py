"""Checkpoint throughput vs dd, and how long async saves block training (one process, gloo, CPU).

    python bench/checkpoint_throughput.py [--state-mb 100] [--repeats 3] [--dir DIR]

save_vs_dd_ratio: dd's time to write and fsync the same number of bytes to the same directory, divided by a
sync save's time through the real CheckpointManager (DCP write + fsync + digests + COMPLETE.json + renames),
medians of ``--repeats``, measured alternately in this run. async_blocking_fraction: the time an async save
blocks the training loop (kick-off plus waiting for the staging copy before the next optimizer step),
divided by the median step time of the same model without a save.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from disttrain.api.manifest import CheckpointManifest
from disttrain.api.spec import CheckpointSpec
from disttrain.trainer import checkpoint as ckpt_mod
from disttrain.trainer import sampler


def build(state_mb: float, width: int = 1024) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    # AdamW keeps two moments: the state is ~3x the parameters.
    params = int(state_mb * 1e6 / 4 / 3)
    layers = max(1, round(params / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU())
                                  for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def train_step(model, opt, x, manager=None) -> None:
    model(x).square().mean().backward()
    if manager is not None:
        manager.before_optimizer_step()
    opt.step()
    opt.zero_grad(set_to_none=True)


def manifest(step: int) -> CheckpointManifest:
    return CheckpointManifest(step=step, samples_consumed=0, data_cursor=0, world_size=1, plan={}, lr_scale=1.0,
                              dataset=sampler.fingerprint(1, 0), metadata_sha256="-", files={}, created_at="-",
                              code_version="bench", config_hash="-")


def dd_seconds(directory: Path, nbytes: int) -> float:
    target = directory / "dd.bin"
    block = 4 * 2**20
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", f"bs={block}", f"count={-(-nbytes // block)}",
                    "conv=fsync"], check=True, capture_output=True)
    seconds = time.perf_counter() - t0
    target.unlink()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mb", type=float, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    group = dist.new_group(backend="gloo")
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    try:
        model, opt = build(args.state_mb)
        x = torch.randn(args.batch, 1024)
        train_step(model, opt, x)  # materialise the optimizer state
        state = {"app": ckpt_mod.ModelOptimState(model, opt), "trainer": ckpt_mod.TrainerState()}

        sync = ckpt_mod.CheckpointManager(root / "sync", CheckpointSpec(keep=1), 0, 1, group)
        sync.save(0, state, manifest(0))  # warm-up: DCP caches its plan after the first save
        save_s, dd_s, nbytes = [], [], 0
        for i in range(args.repeats):
            t0 = time.perf_counter()
            sync.save(i + 1, state, manifest(i + 1))
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
            async_mgr.save(i + 1, state, manifest(i + 1))
            train_step(model, opt, x, async_mgr)  # the next step overlaps the staging copy
            blocked.append(async_mgr.blocked_s - before)
            while async_mgr.local_pending_state()[0]:
                train_step(model, opt, x, async_mgr)
            async_mgr.poll(all_done=True)
        async_mgr.close()

        mb = nbytes / 1e6
        save, dd = statistics.median(save_s), statistics.median(dd_s)
        print(f"state: {mb:.1f} MB in {root}")
        print(f"sync save: median {save:.3f} s ({mb / save:.0f} MB/s); dd conv=fsync: median {dd:.3f} s "
              f"({mb / dd:.0f} MB/s)")
        print(f"step: median {step * 1000:.1f} ms; async save blocked: median {statistics.median(blocked) * 1000:.1f}"
              f" ms (all: {', '.join(f'{b * 1000:.1f}' for b in blocked)})")
        print(f"save_vs_dd_ratio: {dd / save:.2f}")
        print(f"async_blocking_fraction: {statistics.median(blocked) / step:.3f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
