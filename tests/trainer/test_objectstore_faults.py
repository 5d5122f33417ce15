"""Commit safety and fencing of checkpoints in a bucket against a real S3 server (Ceph RADOS Gateway,
tests/s3server.py), with real processes: the bucket's side of what ``test_side_effects.py`` (a SIGKILL at every
phase of a commit on a volume) and ``test_checkpoint_fencing.py`` (a stale group publishing late) show.

One chain of torchrun runs, each with a new, empty local tier (a new pod's emptyDir), each resuming from the bucket
and each SIGKILLing global rank 0 at another phase of the bucket's commit: committed on the local tier and not
uploaded, objects uploaded and not recorded, every object uploaded and no COMPLETE.json, COMPLETE.json written and
the retention not run. After each kill every COMPLETE.json in the bucket lists objects that all exist with their
sizes and ETags, and the checkpoint the next run resumes from downloads with every digest matching; the killed
save is in the bucket only from its COMPLETE.json on. Every step that is run again consumes exactly the samples of
its first run.

A stale group is a real CheckpointManager in this process whose publisher was overtaken by a newer group's claim:
its late save stays on its local tier and never reaches the bucket's COMPLETE.json, and the newer group's
checkpoints are the ones read.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re

import pytest
import torch
import torch.distributed as dist
from tests.manifests import bare_manifest
from tests.trainer.conftest import bucket_contract, bucket_credentials

from disttrain.api.manifest import MANIFEST_FILE
from disttrain.api.spec import CheckpointSpec
from disttrain.trainer.checkpoint import commit
from disttrain.trainer.checkpoint.manager import CheckpointManager, CheckpointPhase, ManagerOptions
from disttrain.trainer.checkpoint.objectstore import Location, ObjectStoreCommitter
from disttrain.trainer.checkpoint.uploads import RetryPolicy

pytestmark = pytest.mark.timeout(300)

PREFIX = "jobs/toy"

KILLS = [
    # (where global rank 0 dies, at the first save of this step or later)
    (CheckpointPhase.PUBLISHED, 2),  # committed on the local tier, rank 0 not uploading yet
    (CheckpointPhase.UPLOADED, 4),  # rank 0's objects in the bucket, not recorded for the publisher
    (CheckpointPhase.BEFORE_BUCKET_MANIFEST, 6),  # every object in the bucket, no COMPLETE.json
    (CheckpointPhase.BUCKET_COMPLETE, 8),  # COMPLETE.json in the bucket, its retention not run
]


def keys_under(s3_bucket, prefix: str) -> set[str]:
    client, bucket = s3_bucket
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{PREFIX}/{prefix}/")
    return {o["Key"].rsplit("/", 1)[1] for page in pages for o in page.get("Contents", [])}


def assert_every_complete_is_whole(view: ObjectStoreCommitter, tmp) -> None:
    """Every COMPLETE.json lists objects that exist with their sizes and ETags; the newest downloads with every
    digest matching (:meth:`ObjectStoreCommitter.download` verifies each byte)."""
    published = view.published()
    assert all(view.problem(p) == "" for p in published), [(p.key_prefix, view.problem(p)) for p in published]
    if published:
        assert commit.validate(view.download(published[0], tmp)).ok


def test_a_sigkill_at_every_phase_of_the_buckets_commit_never_leaves_a_complete_without_its_bytes(
    harness, s3_server, s3_bucket
):
    _, bucket = s3_bucket
    contract = bucket_contract(
        harness, s3_server, bucket, PREFIX, global_batch=8, micro=1, interval=2, max_steps=10, keep=1
    )
    view = ObjectStoreCommitter(s3_bucket[0], Location(bucket, PREFIX))
    resume_from = None
    for i, (phase, at) in enumerate(KILLS):
        name, tier = f"k{i}", harness.tmp / f"tier-{i}"
        rc, log = harness.run(
            2, contract, name, ckpt=tier, TOY_FAULT=f"kill_at:{phase.value}:{at}", **bucket_credentials(s3_server)
        )
        killed = re.search(rf"fault injection: SIGKILL at {phase.value} of step (\d+)", log)
        assert rc != 0 and killed, log[-3000:]
        step = int(killed.group(1))
        if resume_from is not None:
            assert f"resuming from s3://{bucket}/{PREFIX}/step-{resume_from}/r" in log, log[-3000:]
        round_ = max(view.claims())  # the killed group's
        here = keys_under(s3_bucket, f"step-{step}/r{round_}")
        local = commit.validate(tier / f"step-{step}")
        assert local.ok and local.manifest is not None  # committed on the local tier before anything else
        if phase is CheckpointPhase.BUCKET_COMPLETE:
            assert MANIFEST_FILE in here
        else:
            assert MANIFEST_FILE not in here, here  # not a checkpoint in the bucket
        if phase is CheckpointPhase.UPLOADED:
            assert here and ".uploaded" not in here  # rank 0's objects are there; they are not all recorded
        if phase is CheckpointPhase.BEFORE_BUCKET_MANIFEST:
            assert set(local.manifest.files) <= here  # every object of the save, and still no checkpoint
        assert_every_complete_is_whole(view, harness.tmp / f"check-{i}")
        found = view.find_latest()
        if phase is CheckpointPhase.BUCKET_COMPLETE:
            assert found is not None and found.manifest.order == (round_, step)
        else:
            assert found is None or found.manifest.order < (round_, step)
        resume_from = found.manifest.step if found else None

    rc, log = harness.run(2, contract, "last", ckpt=harness.tmp / "tier-last", **bucket_credentials(s3_server))
    assert rc == 0, log[-3000:]
    assert f"resuming from s3://{bucket}/{PREFIX}/step-{resume_from}/r" in log, log[-3000:]
    latest = view.find_latest()
    assert latest is not None and latest.manifest.step == 10
    assert_every_complete_is_whole(view, harness.tmp / "check-last")

    runs = [f"k{i}" for i in range(len(KILLS))] + ["last"]
    seen: dict[tuple[int, int], list] = collections.defaultdict(list)
    for run in runs:
        for r in harness.records(run):
            seen[(r["step"], r["rank"])].append(sorted(r["indices"]))
    assert {step for step, _ in seen} == set(range(1, 11))
    assert all(all(x == runs_of[0] for x in runs_of) for runs_of in seen.values()), "a step redone differently"


@pytest.fixture
def group(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_a_stale_groups_late_save_never_becomes_complete_in_the_bucket(
    tmp_path, group, s3_server, s3_bucket, monkeypatch, caplog
):
    """Two groups of one job on two nodes (two local tiers): the old one's rank 0 saves again after the new group
    claimed its round. Its save commits on its own local tier, its publisher refuses the bucket, and the new group
    resumes from and publishes over the old group's last COMPLETE checkpoint."""
    _, bucket = s3_bucket
    for key, value in bucket_credentials(s3_server).items():
        monkeypatch.setenv(key, value)
    spec = CheckpointSpec.model_validate(
        {
            "uri": f"s3://{bucket}/{PREFIX}",
            "s3": {"endpoint": s3_server.endpoint, "region": "us-east-1", "addressingStyle": "path"},
            "keep": 3,
            "intervalSteps": 1,
        }
    )
    options = ManagerOptions(job_uid="uid-1", upload_retry=RetryPolicy(initial_s=0.2, max_s=0.5))

    def manager(node: str) -> CheckpointManager:
        return CheckpointManager(tmp_path / node, spec, 0, 1, group, dataclasses.replace(options, node=node))

    old = manager("node-a")
    assert old.find_latest() is None
    old.save(2, {"w": torch.full((64,), 2.0)}, bare_manifest(2))
    assert old.tier is not None and old.tier.flush(30)
    new = manager("node-b")
    found = new.find_latest()
    assert found is not None and found.step == 2 and (old.commits.bucket_round, new.commits.bucket_round) == (1, 2)
    new.load(found, {"w": torch.zeros(64)})

    with caplog.at_level(logging.INFO, logger="disttrain.trainer"):
        old.save(3, {"w": torch.full((64,), 3.0)}, bare_manifest(3))  # the old group, late
        assert old.tier.publisher is not None
        old.tier.flush(10)
        assert commit.validate(tmp_path / "node-a" / "step-3").ok  # on its own local tier only
        new.save(4, {"w": torch.full((64,), 4.0)}, bare_manifest(4))
        assert new.tier is not None and new.tier.flush(30)
    assert "checkpoint publishing stops" in caplog.text and "a newer group holds round 2" in caplog.text
    view = ObjectStoreCommitter(s3_bucket[0], Location(bucket, PREFIX))
    assert [p.manifest.order for p in view.published()] == [(2, 4), (1, 2)]  # no step-3 of round 1
    assert MANIFEST_FILE not in keys_under(s3_bucket, "step-3/r1")
    old.close()
    new.close()
