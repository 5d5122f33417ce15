"""Where a sync checkpoint save spends its time (one process, gloo, CPU), with and without the two speed-ups.

    python bench/checkpoint_breakdown.py [--state-mb 100] [--repeats 5] [--dir DIR]

Saves the same model + AdamW state as ``bench/checkpoint_throughput.py`` through the real CheckpointManager,
timing each part by wrapping the functions that do it (wall time per save, averaged; a part run by the two
writer threads is summed over them). Configurations alternate save by save, so all see the same load:
``now`` (writeback started per 8 MiB slice, DCP's plan cached), ``no-writeback`` and ``no-plan-cache`` (each
speed-up off) and ``before`` (both off: the code before them). dd's time for the same bytes is measured in between.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem, utils
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkpoint_throughput as bench  # also puts the repository on sys.path (tests.manifests)
from tests.manifests import bare_manifest

from disttrain.api.spec import CheckpointSpec
from disttrain.trainer.checkpoint import commit, storage, writeback
from disttrain.trainer.checkpoint import manager as ckpt_mod
from disttrain.trainer.checkpoint.committer import Committer
from disttrain.trainer.checkpoint.saving import ShardWriter

CONFIGS = ("now", "no-writeback", "no-plan-cache", "before")
TIMES: dict[str, float] = collections.defaultdict(float)


def timed(owner: Any, name: str, label: str) -> None:
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            TIMES[label] += time.perf_counter() - t0

    setattr(owner, name, wrapper)


PARTS = [  # (owner, function, label), outermost first
    (ckpt_mod.CheckpointManager, "save", "save (total)"),
    (ckpt_mod.ModelOptimState, "state_dict", "  get_state_dict (model + optimizer)"),
    (dcp, "save", "  dcp.save"),
    (utils._DistWrapper, "reduce_scatter", "    planning: local plan, gather, global plan, scatter"),
    (storage.CheckpointWriter, "write_data", "    write_data: copy + crc32 + fsync of the shards"),
    (os, "fsync", "      of which fsync (summed over threads; all fsyncs of the save)"),
    (filesystem.FileSystemWriter, "finish", "    .metadata: pickle + write + fsync + rename"),
    (commit, "digest_files", "  digest_files (digests known: fsync + stat)"),
    (dist, "all_gather_object", "  gather digests (all_gather_object)"),
    (commit, "write_manifest", "  COMPLETE.json: write + fsync + rename + dir fsync"),
    (commit, "publish", "  rename to step-N + parent fsync"),
    (Committer, "retain", "  retention (start of its thread)"),
]


@contextlib.contextmanager
def config(name: str) -> Iterator[None]:
    kick, planner = writeback._sync_file_range, ShardWriter._planner
    if name in ("no-writeback", "before"):
        writeback._sync_file_range = None
    if name in ("no-plan-cache", "before"):
        ShardWriter._planner = lambda self: DefaultSavePlanner()  # type: ignore[method-assign]
    try:
        yield
    finally:
        writeback._sync_file_range, ShardWriter._planner = kick, planner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mb", type=float, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    group = bench.one_process_group(29563)
    root = Path(tempfile.mkdtemp(prefix="ckpt-breakdown-", dir=args.dir))
    for owner, name, label in PARTS:
        timed(owner, name, label)
    try:
        model, opt = bench.build(args.state_mb)
        bench.train_step(model, opt, torch.randn(256, 1024))
        state = {"app": ckpt_mod.ModelOptimState(model, opt), "trainer": ckpt_mod.TrainerState()}
        managers = {c: ckpt_mod.CheckpointManager(root / c, CheckpointSpec(keep=1), 0, 1, group) for c in CONFIGS}
        for c, m in managers.items():  # warm-up (and the plan cache's first fill)
            with config(c):
                m.save(0, state, bare_manifest(0))
                m.join_retention()
        parts: dict[str, dict[str, list[float]]] = {c: collections.defaultdict(list) for c in CONFIGS}
        dd_s, nbytes = [], 0
        for i in range(args.repeats):
            for c, m in managers.items():
                TIMES.clear()
                with config(c):
                    m.save(i + 1, state, bare_manifest(i + 1))
                m.join_retention()
                for label in (p[2] for p in PARTS):
                    parts[c][label].append(TIMES.get(label, 0.0))
                nbytes = sum(f.stat().st_size for f in (root / c / f"step-{i + 1}").iterdir())
            dd_s.append(bench.dd_seconds(root, nbytes))
        for m in managers.values():
            m.close()
        dd = statistics.median(dd_s)
        print(f"state: {nbytes / 1e6:.1f} MB; dd conv=fsync median {dd * 1000:.1f} ms; medians of {args.repeats}, ms")
        print(f"{'part':74s}" + "".join(f"{c:>15s}" for c in CONFIGS))
        for label in (p[2] for p in PARTS):
            print(f"{label:74s}" + "".join(f"{statistics.median(parts[c][label]) * 1000:15.1f}" for c in CONFIGS))
        ratio: Callable[[str], float] = lambda c: dd / statistics.median(parts[c]["save (total)"])  # noqa: E731
        print(f"{'save_vs_dd_ratio':74s}" + "".join(f"{ratio(c):15.2f}" for c in CONFIGS))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
