"""Exactly-once side effects with checkpoints in a bucket, against a real S3 server (Ceph RADOS Gateway,
tests/s3server.py), real torchrun: the bucket's side of ``test_side_effects.py``.

Global rank 0 is SIGKILLed just before the bucket's COMPLETE.json of step 6 (or of a later save, when a newer one
overtook it), while that save is committed on the local tier: by then no effect of a step the bucket does not hold
has reached the downstream sink. A new group with an empty local tier (the killed pods' emptyDirs are gone) resumes
from the bucket's newest COMPLETE and redoes the later steps under its own run's key; the sink, which refuses a key
it has seen, ends with every step's effect exactly once. A key offered again is only that of a step the bucket held
(its confirmation was on the lost tier).
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

import pytest

from disttrain.trainer.checkpoint.manager import CheckpointPhase
from disttrain.trainer.checkpoint.objectstore import Location, ObjectStoreCommitter

pytestmark = pytest.mark.timeout(300)

PREFIX = "jobs/effects"
WORKER = Path(__file__).resolve().parent / "workers" / "effects_worker.py"


def run(harness, contract: str, name: str, ckpt: Path, **env: str) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "disttrain.trainer.launch", "--nproc-per-node=2", "--standalone", "--max-restarts=0"]
    p = harness.popen([*cmd, str(WORKER)], harness.env(contract, name, ckpt, **env), harness.out / f"{name}.log")
    return p.wait(timeout=150), harness.log(name)


def accepted(harness) -> list[str]:
    path = harness.out / "notify.sink"
    return path.read_text().split() if path.exists() else []


def test_effects_run_once_their_step_is_complete_in_the_bucket_and_once_across_a_node_loss(
    harness, s3_server, s3_bucket
):
    client, bucket = s3_bucket
    contract = json.loads(harness.contract(global_batch=4, micro=1, max_steps=12, interval=2, keep=2))
    contract["checkpoint"] |= {
        "uri": f"s3://{bucket}/{PREFIX}/",
        "s3": {"endpoint": s3_server.endpoint, "region": "us-east-1", "addressingStyle": "path"},
    }
    env = {
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        "TOY_STEP_SLEEP": "0.4",
    }
    fault = f"{CheckpointPhase.BEFORE_BUCKET_MANIFEST.value}:6+"  # the publisher may skip a save a newer one overtook
    rc, log = run(harness, json.dumps(contract), "a", harness.tmp / "tier-a", EFFECT_FAULT=fault, **env)
    killed = re.search(r"fault injection: SIGKILL at before_bucket_manifest of step (\d+)", log)
    assert rc != 0 and killed, log[-3000:]
    view = ObjectStoreCommitter(client, Location(bucket, PREFIX))
    newest = view.find_latest()
    in_bucket = newest.manifest.step if newest is not None else 0
    assert in_bucket < int(killed.group(1))
    first = accepted(harness)
    assert all(int(k.split("/")[1]) <= in_bucket for k in first), (in_bucket, first)  # none beyond the bucket

    rc, log = run(harness, json.dumps(contract), "b", harness.tmp / "tier-b", **env)
    assert rc == 0, log[-3000:]
    if in_bucket:
        assert f"resuming from s3://{bucket}/{PREFIX}/step-{in_bucket}/r" in log, log[-3000:]
    notified = accepted(harness)
    assert collections.Counter(int(k.split("/")[1]) for k in notified) == dict.fromkeys(range(1, 13), 1), notified
    refused = (harness.out / "notify.refused").read_text().split() if (harness.out / "notify.refused").exists() else []
    assert set(refused) <= set(first), refused  # offered again only with the key the sink already took
    latest = view.find_latest()
    assert latest is not None and latest.manifest.step == 12  # the last save reached the bucket before the exit
