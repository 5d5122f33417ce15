"""A stale group (rank 0 of an old rendezvous round) can neither publish nor delete once a new group took over.

Both groups are real CheckpointManagers writing real DCP checkpoints through a one-process gloo group; the stale
one commits from inside the new group's save, the moment when the new group's temporary directory holds its
written files and a stale retention would have deleted it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from disttrain.api.manifest import CheckpointManifest, DatasetFingerprint
from disttrain.api.spec import CheckpointSpec
from disttrain.trainer import commit
from disttrain.trainer.checkpoint import CheckpointManager, CheckpointPhase

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def group(tmp_path: Path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def manifest(step: int) -> CheckpointManifest:
    return CheckpointManifest(step=step, samples_consumed=step, data_cursor=step, world_size=1, plan={},
                              lr_scale=1.0, dataset=DatasetFingerprint(length=9, seed=0), metadata_sha256="pending",
                              files={}, created_at="pending", code_version="t", config_hash="h")


def state(value: float) -> dict:
    return {"w": torch.full((64,), value)}


def test_a_stale_group_cannot_publish_or_delete_the_new_groups_save(tmp_path, group, caplog):
    root = tmp_path / "ckpt"
    spec = CheckpointSpec(keep=1, intervalSteps=1)
    old = CheckpointManager(root, spec, 0, 1, group, job_uid="uid-1", node="node-a")
    assert old.find_latest() is None
    old.save(2, state(2.0), manifest(2))
    assert (root / "step-2").is_dir()

    stale_commit: dict = {}

    def old_group_commits_now(phase: CheckpointPhase, step: int) -> None:
        if phase is CheckpointPhase.FILES_WRITTEN and step == 4:
            stale_commit["temps"] = [p.name for p in root.iterdir() if p.name.startswith(commit.TMP_PREFIX)]
            old.save(3, state(3.0), manifest(3))  # the partitioned old rank 0 finishes its commit late
            old.join_retention()

    new = CheckpointManager(root, spec, 0, 1, group, job_uid="uid-1", node="node-b", on_phase=old_group_commits_now)
    found = new.find_latest()
    assert found is not None and found.step == 2
    new.load(found, state(0.0))
    assert (old.fence_round, new.fence_round) == (1, 2)

    with caplog.at_level(logging.INFO, logger="disttrain.trainer"):
        new.save(4, state(4.0), manifest(4))
        new.join_retention()

    assert len(stale_commit["temps"]) == 1 and "-r2-" in stale_commit["temps"][0]  # the new group's save in flight
    assert "holds round 1, a newer group holds round 2 (claimed by node node-b" in caplog.text
    assert old.consecutive_failures == 1
    names = sorted(p.name for p in root.iterdir() if p.name != ".fence")
    assert names == ["step-2", "step-4"], names  # step-3 never published; the loaded step-2 is kept
    committed = commit.validate(root / "step-4")
    assert committed.ok and committed.manifest is not None
    assert (committed.manifest.job_uid, committed.manifest.fence_round) == ("uid-1", 2)
