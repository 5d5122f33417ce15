"""The reform directive frees a survivor blocked in a device wait: real launchers and torchrun, gloo, rank 1's device
wait of step 6 never ending on its own (fault injection standing for an NCCL kernel spinning on a dead peer) and
rank 0 blocked in the step's agreement behind it. The directive's abort ends the wait, the step is not counted, and
the blocked rank re-forms in place without exiting; the group redoes step 6 from the state held in memory. (Rank 0's
gloo receive behind it ends when rank 1's abort shuts down its group's connections; on NCCL the same abort frees
it.)"""

from __future__ import annotations

import pytest
from tests.trainer.test_inplace_reform import launcher_args

from disttrain.api import control

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_survivor_blocked_in_a_device_wait_leaves_on_the_directive_and_redoes_the_step(harness):
    port = harness.start_store()
    contract = harness.contract(global_batch=4, micro=1, max_steps=12, interval=4, timeout=60, reform_in_place=True)
    extra = {
        "TOY_STEP_SLEEP": "0.1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "DISTTRAIN_AGENT_ENDPOINT": f"127.0.0.1:{port}",
        "DISTTRAIN_FAULT_HANG_DEVICE_WAIT": "6:1",
    }
    runs = ["a", "b"]
    agents = {run: harness.start(1, contract, run, torchrun_args=launcher_args(port, 2), **extra) for run in runs}
    harness.wait_until("step 5 at the whole world", lambda: any(r["step"] >= 6 for r in harness.records("a")), 120)
    store = harness.client(port)
    signal = control.ControlSignal(generation=1, action="reform", reason="NodeLost", job_uid=harness.job_uid)
    store.set(control.SIGNAL_KEY, signal.model_dump_json())
    for run in runs:
        assert agents[run].wait(timeout=200) == 0, harness.log(run)[-4000:]
    logs = "".join(harness.log(run) for run in runs)
    assert "the loop is blocked; aborted" in logs, logs[-4000:]
    assert "step 6: this rank's (communicators aborted by the reform directive)" in logs, logs[-4000:]
    assert "resumed in place from step 5 held in memory" in logs, logs[-4000:]
    assert "re-forming in place after step 5 (collective failed: StepAbortedError)" in logs, logs[-4000:]
    final = [r for run in runs for r in harness.records(run) if r["step"] == 12]
    assert final, "the run reached its last step"
