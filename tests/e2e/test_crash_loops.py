"""Crash loops count: local mode end to end with the real launcher, torchrun, agent and trainer processes.

Before the launcher, torchrun (run with a huge ``--max-restarts`` so that drains and reforms never run out)
restarted a failing script in place forever: phase Pending or Running, restarts ``{}``, no word of the failure.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import e2e_job, run_job

pytestmark = pytest.mark.timeout(300)


def test_a_deterministic_bug_spends_the_restart_budget_and_fails_with_the_traceback_line(tmp_path):
    job = e2e_job("crashloop", tmp_path / "out", replicas=1, extra_env={"E2E_RAISE_AT_STEP": "3"}).set(
        "spec.restartPolicy", {"maxRestarts": 1, "backoffSeconds": 1}
    )
    run = run_job(tmp_path, job, timeout_s=200)
    status = run.runtime.obj["status"]
    assert status["phase"] == "Failed", status.get("message")
    # One retry happened; the second crash found the budget spent and failed the job without a restart.
    assert status["restarts"]["total"] == 1 and status["restarts"]["byReason"] == {"PodFailed": 1}
    assert "nextRestartTime" not in status and "incident" not in status
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "RestartBudgetExhausted"
    assert "exit code 1" in status["message"] and "RuntimeError: injected bug at step 3" in status["message"]
    assert any(
        e["reason"] == "RestartBudgetExhausted" and "RuntimeError: injected bug at step 3" in e["message"]
        for e in run.events
    )


def test_the_exit_code_classes_see_the_users_real_exit_code(tmp_path):
    job = e2e_job("exit3", tmp_path / "out", replicas=1, extra_env={"E2E_EXIT_AT_START": "3"}).set(
        "spec.restartPolicy", {"maxRestarts": 5, "backoffSeconds": 1, "exitCodes": {"permanent": [3]}}
    )
    run = run_job(tmp_path, job, timeout_s=120)
    status = run.runtime.obj["status"]
    assert status["phase"] == "Failed", status.get("message")
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "PermanentExitCode"
    assert "exited with code 3" in failed["message"] and "worker rank 0 failed with exit code 3" in failed["message"]
    assert status["restarts"]["total"] == 0


def test_one_crash_is_one_restart_and_the_replacement_joins_the_group(tmp_path):
    # One process raises once: its pod fails (one restart, PodFailed), the survivor re-forms, and the replacement
    # joins the same rendezvous (torchrun would have closed it on the failed node's way out).
    job = e2e_job(
        "crashonce",
        tmp_path / "out",
        replicas=2,
        max_steps=14,
        extra_env={"E2E_RAISE_AT_STEP": "6", "E2E_RAISE_ONCE": "1"},
    ).set("spec.restartPolicy", {"maxRestarts": 3, "backoffSeconds": 0})
    run = run_job(tmp_path, job, timeout_s=240)
    status = run.runtime.obj["status"]
    assert status["phase"] == "Succeeded", status.get("message")
    assert status["restarts"]["total"] == 1 and status["restarts"]["byReason"] == {"PodFailed": 1}
    assert "RuntimeError: injected bug at step 6" in status["lastFailure"]
    assert max(run.final_trajectory()) == 14
