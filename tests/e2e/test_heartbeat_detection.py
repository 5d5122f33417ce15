"""A dead node is found from the rendezvous heartbeats, before Kubernetes marks it NotReady.

Local mode with a Kubernetes-like NotReady delay (20 s, as node-monitor-grace-period on a small cluster): the
machine's processes die at once, its node reads Ready and its pod Running until the delay passes. The operator's
reform directive, with the reason HeartbeatLost, must come before that, and the job must finish with one restart.
"""

from __future__ import annotations

import time

import pytest

from tests.e2e.conftest import e2e_job, run_job

pytestmark = [pytest.mark.slow]

NOT_READY_DELAY_S = 20.0


@pytest.mark.timeout(240)
def test_the_directive_comes_from_the_heartbeats_before_the_node_is_notready(tmp_path):
    seen: dict[str, object] = {}

    def on_tick(runtime, snapshot):
        lost = [p for p in runtime.workers.values() if p.node_lost]
        if lost and "victim" not in seen:
            seen["victim"] = lost[0]
        control = snapshot.status.get("control") or {}
        if control.get("action") == "reform" and "directive" not in seen:
            seen["directive"] = (time.time(), control.get("reason"), list(control.get("exclude") or []))

    run = run_job(
        tmp_path,
        e2e_job("hb", tmp_path / "records", replicas=2, step_sleep=0.05),
        chaos="kill-node@step=6",
        on_tick=on_tick,
        not_ready_delay_s=NOT_READY_DELAY_S,
    )
    assert run.summary.succeeded, run.reasons()
    victim = seen["victim"]
    directive_at, reason, exclude = seen["directive"]
    assert reason == "HeartbeatLost"
    assert victim.name in exclude, "the silent pod is fenced out of the next round"
    assert directive_at < victim.not_ready_at, (
        f"the directive came {directive_at - victim.not_ready_at:.1f} s after the node was marked NotReady"
    )
    assert run.summary.infrastructure_losses_by_reason == {"HeartbeatLost": 1}
    assert run.summary.restarts_by_reason == {}
