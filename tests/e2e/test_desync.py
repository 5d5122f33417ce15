"""A rank that skips a collective, in debug mode: the job fails at once naming the ranks and the operations.

Without ``spec.debug`` the peer that ran the extra collective would wait in it until the collective timeout and the
group would re-form into the same bug. With ``distributed: DETAIL`` torch checks each collective's fingerprint
across the ranks first; the trainer names the mismatch and exits PERMANENT, and the operator fails the job as
``CollectiveDesync`` in its status and an Event. Local mode end to end: real launcher, torchrun, agent, trainer.
"""

from __future__ import annotations

import time

import pytest

from tests.e2e.conftest import e2e_job, run_job

pytestmark = pytest.mark.timeout(300)

COLLECTIVE_TIMEOUT_S = 600


def test_a_rank_that_skips_a_collective_fails_the_job_within_seconds_naming_ranks_and_operations(tmp_path):
    job = (
        e2e_job(
            "desync",
            tmp_path / "out",
            replicas=2,
            extra_env={"E2E_DESYNC_STEP": "3", "E2E_DESYNC_SKIP_RANK": "1"},
        )
        .set("spec.elastic.collectiveTimeoutSeconds", COLLECTIVE_TIMEOUT_S)
        .set("spec.debug", {"distributed": "DETAIL", "perRankLogs": True})
        .set("spec.restartPolicy", {"maxRestarts": 5, "backoffSeconds": 0})
    )
    run = run_job(tmp_path, job, timeout_s=200)
    ended = time.time()
    status = run.runtime.obj["status"]

    assert status["phase"] == "Failed", status.get("message")
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "CollectiveDesync", failed
    # Rank 0 ran the extra broadcast; rank 1 skipped it and went on to the step boundary's all-reduce.
    for text in (status["message"], failed["message"]):
        assert "collective desync: " in text and "a restart would repeat it" in text
        assert "rank 0 called BROADCAST" in text and "rank 1 called ALLREDUCE" in text
    assert status["restarts"]["total"] == 0, status["restarts"]  # a bug: never re-formed, never restarted
    events = [e for e in run.events if e["reason"] == "CollectiveDesync"]
    assert events and "rank 0 called BROADCAST" in events[0]["message"], run.reasons()

    # Within seconds of the skipped collective, far below the collective timeout.
    last_step = max(r["time"] for r in run.records())
    assert max(r["step"] for r in run.records()) <= 3
    assert ended - last_step < 45 < COLLECTIVE_TIMEOUT_S

    # Per-rank logs: one folder per node start, one per local rank, holding the worker's own output.
    logs = sorted(tmp_path.glob("**/debug/*/*/logs/*/attempt_*/0/stderr.log"))
    assert len(logs) == 2, logs
    assert len({p.parents[4] for p in logs}) == 2  # the two nodes' debug folders
    for path in logs:  # each rank's own words, and torch's fingerprints
        text = path.read_text()
        assert "ERROR collective desync: rank " in text and "Detected mismatch between collectives" in text, path
