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
from tests.checkpoint_tensors import load_tensors
from tests.manifests import bare_manifest

from disttrain.api.manifest import CheckpointManifest
from disttrain.api.spec import CheckpointSpec
from disttrain.trainer.checkpoint import commit
from disttrain.trainer.checkpoint.manager import CheckpointManager, CheckpointPhase, ManagerOptions

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def group(tmp_path: Path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def manifest(step: int) -> CheckpointManifest:
    return bare_manifest(step)


def state(value: float) -> dict:
    return {"w": torch.full((64,), value)}


def node_manager(root: Path, spec: CheckpointSpec, group, node: str, on_phase=None) -> CheckpointManager:
    """The checkpoint manager of the job's group on ``node`` (one rank)."""
    return CheckpointManager(root, spec, 0, 1, group, ManagerOptions(job_uid="uid-1", node=node, on_phase=on_phase))


def resume_from_step_2(manager: CheckpointManager) -> None:
    """A new group resumes: the latest checkpoint it finds is step 2."""
    found = manager.find_latest()
    assert found is not None and found.step == 2
    manager.load(found, state(0.0))


def test_a_stale_group_cannot_publish_or_delete_the_new_groups_save(tmp_path, group, caplog):
    root = tmp_path / "ckpt"
    spec = CheckpointSpec(keep=1, intervalSteps=1)
    old = node_manager(root, spec, group, "node-a")
    assert old.find_latest() is None
    old.save(2, state(2.0), manifest(2))
    assert (root / "step-2").is_dir()

    stale_commit: dict = {}

    def old_group_commits_now(phase: CheckpointPhase, step: int) -> None:
        if phase is CheckpointPhase.FILES_WRITTEN and step == 4:
            stale_commit["temps"] = [p.name for p in root.iterdir() if p.name.startswith(commit.TMP_PREFIX)]
            old.save(3, state(3.0), manifest(3))  # the partitioned old rank 0 finishes its commit late
            old.join_retention()

    new = node_manager(root, spec, group, "node-b", old_group_commits_now)
    resume_from_step_2(new)
    assert (old.commits.fence_round, new.commits.fence_round) == (1, 2)

    with caplog.at_level(logging.INFO, logger="disttrain.trainer"):
        new.save(4, state(4.0), manifest(4))
        new.join_retention()

    assert len(stale_commit["temps"]) == 1 and "-r2-" in stale_commit["temps"][0]  # the new group's save in flight
    assert "holds round 1, a newer group holds round 2 (claimed by node node-b" in caplog.text
    assert old.commits.consecutive_failures == 1
    names = sorted(p.name for p in root.iterdir() if p.name != ".fence")
    assert names == ["step-2", "step-4"], names  # step-3 never published; the loaded step-2 is kept
    committed = commit.validate(root / "step-4")
    assert committed.ok and committed.manifest is not None
    assert (committed.manifest.job_uid, committed.manifest.fence_round) == ("uid-1", 2)


def test_a_stale_group_frozen_before_its_rename_cannot_replace_the_newer_groups_checkpoint_of_the_same_step(
    tmp_path, group, caplog
):
    """The stale rank 0 passed its last fence check, then froze; meanwhile a new group claimed the next round,
    resumed and committed the same step. When the stale one wakes up and renames, the newer step-4 stays."""
    root = tmp_path / "ckpt"
    spec = CheckpointSpec(keep=3, intervalSteps=1)
    woke: dict = {}

    def new_group_commits_while_the_old_one_is_frozen(phase: CheckpointPhase, step: int) -> None:
        if phase is CheckpointPhase.BEFORE_PUBLISH and step == 4 and not woke:
            woke["new"] = new = node_manager(root, spec, group, "node-b")
            resume_from_step_2(new)
            new.save(4, state(40.0), manifest(4))
            new.join_retention()

    old = node_manager(root, spec, group, "node-a", new_group_commits_while_the_old_one_is_frozen)
    assert old.find_latest() is None
    old.save(2, state(2.0), manifest(2))
    with caplog.at_level(logging.INFO, logger="disttrain.trainer"):
        old.save(4, state(4.0), manifest(4))  # publishes after the new group's step-4
        old.join_retention()

    assert "step-4 committed by fence round 2; this group holds round 1" in caplog.text, caplog.text[-2000:]
    assert old.commits.consecutive_failures == 1 and woke["new"].commits.consecutive_failures == 0
    v = commit.validate(root / "step-4")
    assert v.ok and v.manifest is not None and v.manifest.fence_round == 2
    assert torch.equal(load_tensors(root / "step-4", prefix="")["w"], torch.full((64,), 40.0))
    assert sorted(p.name for p in root.iterdir() if p.name != ".fence") == ["step-2", "step-4"]


def test_a_stale_groups_late_commit_at_a_higher_step_never_shadows_the_newer_rounds_checkpoint(tmp_path, group):
    """The stale group's step-5 lands (the rename window) after the new group resumed from step-2: the next resume
    still picks the new group's step-4 (round 2 beats round 1) although step-5 is valid and kept (keep: 3)."""
    root = tmp_path / "ckpt"
    spec = CheckpointSpec(keep=3, intervalSteps=1)
    groups: dict = {}

    def new_group_resumes_while_the_old_one_is_frozen(phase: CheckpointPhase, step: int) -> None:
        if phase is CheckpointPhase.BEFORE_PUBLISH and step == 5:
            groups["new"] = new = node_manager(root, spec, group, "node-b")
            resume_from_step_2(new)

    old = node_manager(root, spec, group, "node-a", new_group_resumes_while_the_old_one_is_frozen)
    assert old.find_latest() is None
    old.save(2, state(2.0), manifest(2))
    old.save(5, state(5.0), manifest(5))  # nothing newer is committed yet: the stale step-5 is published
    old.join_retention()
    assert (root / "step-5").is_dir()

    new = groups["new"]
    new.save(4, state(4.0), manifest(4))
    new.join_retention()
    third = node_manager(root, spec, group, "node-c")
    found = third.find_latest()
    assert found is not None and (found.step, found.fence_round) == (4, 2)
    assert sorted(p.name for p in root.iterdir() if p.name != ".fence") == ["step-2", "step-4", "step-5"]


def test_with_keep_1_the_previous_checkpoint_survives_until_the_new_one_reads_back(tmp_path, group, caplog):
    root = tmp_path / "ckpt"
    spec = CheckpointSpec(keep=1, intervalSteps=1)

    def damage_right_after_the_rename(phase: CheckpointPhase, step: int) -> None:
        if phase is CheckpointPhase.PUBLISHED and step == 4:
            shard = next((root / "step-4").glob("*.distcp"))
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF  # the bytes on the volume are not the bytes written
            shard.write_bytes(bytes(data))

    ckpt = CheckpointManager(root, spec, 0, 1, group, ManagerOptions(on_phase=damage_right_after_the_rename))
    assert ckpt.find_latest() is None
    ckpt.save(2, state(2.0), manifest(2))
    ckpt.join_retention()
    with caplog.at_level(logging.INFO, logger="disttrain.trainer"):
        ckpt.save(4, state(4.0), manifest(4))
        ckpt.join_retention()
    assert "checkpoint step-4 does not read back (file __0_0.distcp is corrupt" in caplog.text, caplog.text[-2000:]
    assert sorted(p.name for p in root.iterdir() if p.name != ".fence") == ["step-2", "step-4"]
    assert commit.find_latest(root).step == 2  # still something to resume from

    ckpt.save(6, state(6.0), manifest(6))
    ckpt.join_retention()
    assert sorted(p.name for p in root.iterdir() if p.name != ".fence") == ["step-6"]  # corrupt step-4 cleaned
