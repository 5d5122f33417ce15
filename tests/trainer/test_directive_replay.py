"""A replayed old directive during a reform: the worker pod's launcher with the disttrain rendezvous on a store
hosted by a separate process (the job agent's role, played by the test, which stamps each directive with the round
it was issued for as the agent does).

The attack: while a reform is in flight, a process past the store's front writes the job's older directive and
plan back (genuine values once, validly signed), so the fresh workers of the next round take the old generation as
their history; then the directive that formed their round comes back (the agent's guardian restores the newest
value). Its generation is above their history, but it was issued for the round before theirs: they train on and
the run ends successfully, with no second reform."""

from __future__ import annotations

import pytest

from disttrain.api import control
from disttrain.trainer.agent import heartbeats

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

RUN_ID = "toy"


def torchrun_args(port: int) -> list[str]:
    conf = "is_host=false,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=60"
    return [
        "--nnodes=1",
        "--rdzv-backend=disttrain",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={RUN_ID}",
        f"--rdzv-conf={conf}",
        "--max-restarts=0",
        "--monitor-interval=0.2",
    ]


def publish(store, generation: int, action: str, round_: int, lost: tuple[str, ...] = ()) -> None:
    """What the agent writes for ``status.control``: the signal, then the target plan, both stamped with ``round_``."""
    signal = control.ControlSignal(generation=generation, action=action, job_uid="uid-harness", round=round_)
    plan = control.TargetPlan(generation=generation, nodes=1, lost=list(lost), job_uid="uid-harness", round=round_)
    store.set(control.SIGNAL_KEY, signal.model_dump_json())
    store.set(control.TARGET_KEY, plan.model_dump_json())
    store.get(control.TARGET_KEY)  # answered after both sets: the values are in the store


def test_a_replayed_old_directive_during_a_reform_causes_no_second_reform(harness):
    port = harness.start_store()
    store = harness.client(port)
    contract = harness.contract(global_batch=4, micro=1, max_steps=40, interval=5)

    def node(run: str, name: str):
        extra = {
            "TOY_STEP_SLEEP": "0.1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "DISTTRAIN_AGENT_ENDPOINT": f"127.0.0.1:{port}",
            "DISTTRAIN_NODE_NAME": name,
            "DISTTRAIN_NODE_INDEX": "0",
        }
        return harness.start(2, contract, run, torchrun_args=torchrun_args(port), **extra)

    publish(store, 0, "none", control.NO_ROUND)  # the job's first directive: nothing to do yet
    first = node("one", "node-a")
    harness.wait_for_step("one", 3, timeout=120)
    view = heartbeats.read_state(store, RUN_ID)
    assert view is not None and view.complete, view
    issued_for = control.last_complete_round(view.round, view.complete)
    publish(store, 1, "reform", issued_for, lost=("node-a",))  # node-a's group is to reform
    harness.assert_exited(first.wait(timeout=60), harness.log("one"), 84)

    publish(store, 0, "none", control.NO_ROUND)  # the replay, while the next round has not formed yet
    second = node("two", "node-b")
    harness.wait_for_step("two", 8, timeout=120)  # its watchdog took generation 0 as history
    publish(store, 1, "reform", issued_for, lost=("node-a",))  # the newest directive put back
    rc = second.wait(timeout=120)
    log = harness.log("two")
    assert rc == 0, f"exit {rc}:\n{log[-3000:]}"
    assert "reform signal" not in log, log[-3000:]
    assert f"directive generation 1 (reform) not acted on: issued for round {issued_for}" in log, log[-3000:]
    assert max(r["step"] for r in harness.records("two")) == 40
