"""One lost node, one infrastructure loss: local mode end to end, with survivors that die the way NCCL's watchdog
kills them.

On GPUs torchrun sets ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``: when a node dies mid-collective every survivor's watchdog
aborts its process (SIGABRT, the pod exits 134). Gloo on CPU raises instead, so the trainer's fault hook
(``trainer/failures.py``, ``FAULT_INJECT_ABORT_ON_COLLECTIVE_FAILURE``) aborts a survivor as soon as its collective
fails. The operator must charge the whole incident once.
"""

from __future__ import annotations

import pytest

from disttrain.trainer.failures import FAULT_ABORT_ON_COLLECTIVE_FAILURE
from tests.e2e.conftest import e2e_job, run_job

pytestmark = pytest.mark.timeout(180)


def test_a_lost_node_whose_survivors_abort_is_one_infrastructure_loss_and_the_job_recovers(tmp_path):
    job = e2e_job(
        "abort",
        tmp_path / "out",
        replicas=3,
        max_steps=16,
        step_sleep=0.3,  # the runtime sees step 6 a tick late: the kill must still land mid-training
        extra_env={FAULT_ABORT_ON_COLLECTIVE_FAILURE: "1"},
    ).set("spec.restartPolicy", {"maxRestarts": 3, "backoffSeconds": 0})
    # Heartbeat silence is not what this test is about: a loaded machine can stall a starting node for seconds.
    job.set("spec.rendezvous.keepAliveIntervalSeconds", 1).set("spec.rendezvous.keepAliveMaxAttempts", 30)
    job.set("spec.rendezvous.silentAfterSeconds", 30)
    # The dead machine reads NotReady 2 s after it died, as Kubernetes notices late.
    run = run_job(tmp_path, job, chaos="kill-node@step=6", timeout_s=150, not_ready_delay_s=2.0)
    status = run.runtime.obj["status"]
    assert status["phase"] == "Succeeded", (status.get("message"), run.reasons())
    # Charged once, as a node loss: NodeLost when an abort was seen first, NodeNotReady when the dead machine was;
    # never to maxRestarts.
    losses = status["infrastructureLosses"]
    assert losses["total"] == 1 and status["restarts"]["total"] == 0, (losses, status["restarts"])
    assert list(losses["byReason"].items()) in ([("NodeLost", 1)], [("NodeNotReady", 1)]), status
    folded = [e["message"] for e in run.events if e["reason"] == "PartOfIncident"]
    assert any("exit code 134" in message for message in folded), run.reasons()
    assert "PodFailed" not in run.reasons()
    assert max(run.final_trajectory()) == 16
