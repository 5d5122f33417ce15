"""Training with ``checkpoint.uri`` against a real S3 server (Ceph RADOS Gateway, tests/s3server.py), real torchrun.

A job saves to its local tier and uploads in the background; it is SIGKILLed mid-run, and a new group at another
world size with an empty local tier (a new pod's emptyDir) resumes from the bucket's newest COMPLETE checkpoint:
the consumed samples are exactly the uninterrupted run's and the final parameters within the drift docs/trainer.md
publishes for a world-size change. With the gateway stopped for 60 s mid-run (async saves), steps keep being run
while it is down, every COMPLETE in the bucket lists all its bytes, and the last save becomes COMPLETE once it is
back.
"""

from __future__ import annotations

import itertools
import re
import time

import pytest
import torch
from tests.trainer import drift
from tests.trainer.conftest import bucket_contract, bucket_credentials, consumed

from disttrain.trainer.checkpoint import commit
from disttrain.trainer.checkpoint.objectstore import Location, ObjectStoreCommitter
from disttrain.trainer.checkpoint.tiered import MAX_LOCAL_COPIES

pytestmark = pytest.mark.timeout(420)

PREFIX = "jobs/toy"
OUTAGE_S = 60


def bucket_view(s3_bucket) -> ObjectStoreCommitter:
    client, bucket = s3_bucket
    return ObjectStoreCommitter(client, Location(bucket, PREFIX))


def newest_step(view: ObjectStoreCommitter) -> int:
    found = view.find_latest()
    return found.manifest.step if found is not None else -1


def test_a_job_killed_mid_run_resumes_from_the_bucket_at_another_world_size(harness, s3_server, s3_bucket):
    _, bucket = s3_bucket
    contract = bucket_contract(harness, s3_server, bucket, PREFIX, global_batch=12, micro=1, interval=2, max_steps=10)
    reference = harness.contract(global_batch=12, micro=1, interval=2, max_steps=10)  # on a volume, uninterrupted
    rc, log = harness.run(4, reference, "ref", ckpt=harness.tmp / "ref-volume")
    assert rc == 0, log[-3000:]

    first = harness.start(4, contract, "first", TOY_STEP_SLEEP="1.0", **bucket_credentials(s3_server))
    view = bucket_view(s3_bucket)
    harness.wait_until("a COMPLETE checkpoint of step 4 or later", lambda: newest_step(view) >= 4, 120)
    harness.kill_tree(first.pid)
    first.wait(10)
    newest = view.find_latest()
    assert newest is not None and 4 <= newest.manifest.step < 10, harness.log("first")[-3000:]
    assert all(view.problem(p) == "" for p in view.published()), "a COMPLETE without all its bytes"
    resumed_at = newest.manifest.step

    tier = harness.tmp / "new-pod-tier"  # the killed pods' emptyDirs are gone with them
    rc, log = harness.run(2, contract, "w2", ckpt=tier, **bucket_credentials(s3_server))
    assert rc == 0, log[-3000:]
    assert f"resuming from s3://{bucket}/{PREFIX}/step-{resumed_at}/r" in log
    assert f"resumed from checkpoint step-{resumed_at} (saved at world size 4) at world size 2" in log
    rows = harness.records("w2")
    assert min(r["step"] for r in rows) == resumed_at + 1 and max(r["step"] for r in rows) == 10
    expected = consumed(harness.records("ref"), range(1, 11))
    got = consumed(harness.records("first"), range(1, resumed_at + 1)) + consumed(rows, range(resumed_at + 1, 11))
    assert got == expected, f"replayed: {got - expected}, skipped: {expected - got}"
    ref_final, final = torch.load(harness.out / "ref-final.pt"), torch.load(harness.out / "w2-final.pt")
    bound = drift.HEADROOM * drift.published("toy AdamW")[(4, 2)].max_param_diff
    for name, value in ref_final.items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=bound, msg=name)
    latest = view.find_latest()
    assert latest is not None and (latest.manifest.step, latest.manifest.world_size) == (10, 2)
    assert (latest.manifest.fence_round or 0) > (newest.manifest.fence_round or 0)  # the new group's round
    local = [int(p.name[5:]) for p in tier.iterdir() if re.match(r"^step-\d+$", p.name)]
    assert max(local) == 10 and len(local) <= MAX_LOCAL_COPIES  # the local tier within its bound


def test_an_unreachable_bucket_never_stops_training_and_completes_once_back(harness, s3_server, s3_bucket):
    """The gateway is stopped for 60 s mid-run: the steps advance in every 10 s of it, the uploads and the publisher
    keep failing and retrying (``checkpoint_upload_retry`` shortened to 0.2 s doubling to 1 s, so that the minute
    holds many attempts), and once the gateway is back the job ends with its last save COMPLETE and every COMPLETE
    lists all its bytes. At 0.5 s a step, 140 steps outlast the outage on any machine. Async saves: the sync ones
    are the other test's."""
    _, bucket = s3_bucket
    contract = bucket_contract(
        harness, s3_server, bucket, PREFIX, global_batch=12, micro=1, interval=2, max_steps=140, async_save=True
    )
    run = harness.start(
        2, contract, "outage", TOY_STEP_SLEEP="0.5", TOY_UPLOAD_RETRY="0.2,1", **bucket_credentials(s3_server)
    )
    harness.wait_for_step("outage", 1, timeout=120)
    view = bucket_view(s3_bucket)

    def newest_step_run() -> int:
        return max(r["step"] for r in harness.records("outage"))

    s3_server.stop_gateway()
    stopped = time.monotonic()
    try:
        down_at = newest_step_run()
        progress = [down_at]  # the newest step at every 10 s of the outage
        while len(progress) <= OUTAGE_S // 10:
            time.sleep(max(0.0, stopped + 10 * len(progress) - time.monotonic()))
            progress.append(newest_step_run())
        assert all(later > earlier for earlier, later in itertools.pairwise(progress)), progress  # no step waited
        assert run.poll() is None, "the job ended during the outage: it did not span it"
        log = harness.log("outage")
        assert "Could not connect" in log and "checkpoint bucket behind" in log, log[-3000:]
        assert "failed (attempt 3," in log
    finally:
        s3_server.start_gateway()
    assert time.monotonic() - stopped >= OUTAGE_S
    assert run.wait(240) == 0, harness.log("outage")[-3000:]
    latest = view.find_latest()
    assert latest is not None and latest.manifest.step == 140  # COMPLETE once the gateway is back
    published = view.published()
    assert all(view.problem(p) == "" for p in published), "a COMPLETE without all its bytes"
    assert commit.validate(view.download(latest, harness.tmp / "check")).ok  # every digest matches
