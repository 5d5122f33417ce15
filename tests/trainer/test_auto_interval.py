"""checkpoint.intervalSteps: auto on a real torchrun group (gloo, CPU, a real kill): the group saves at the interval
rank 0 computes from its measured save cost and step time and the failure history in the agent's store, and
re-estimates it after a failure."""

from __future__ import annotations

import json
import math
import statistics
import time

import pytest

from disttrain.api import control, interval

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def committed_steps(harness) -> list[int]:
    if not harness.ckpt.exists():
        return []
    return sorted(int(n.removeprefix("step-")) for n in harness.ckpt_names() if n.startswith("step-"))


def intervals_by_step(harness, run: str) -> dict[int, int]:
    """Step -> the interval the group had agreed when rank 0 ran it (None before the first agreement)."""
    return {r["step"]: r["interval"] for r in harness.records(run) if r["rank"] == 0}


def assert_saved_by_the_rule(commits: list[int], start: int, agreed: dict[int, int]) -> None:
    """Each save at ``c`` is the first step after the previous one ``p`` with c - p >= I(c), I(s) being the interval
    in force at the boundary of step s (recorded with step s + 1)."""
    previous = start
    for c in commits:
        assert c - previous >= agreed[c + 1], (previous, c, agreed[c + 1])
        assert all(agreed[s + 1] is None or s - previous < agreed[s + 1] for s in range(previous + 1, c)), (previous, c)
        previous = c


def report(store) -> control.IntervalReport:
    value = control.read_model(store, control.INTERVAL_KEY, control.IntervalReport)
    assert value is not None
    return value


def check_report(value: control.IntervalReport, failures: int, started_at: float) -> None:
    assert value.failures == failures
    assert value.steps == interval.interval_steps(value.save_seconds, value.step_seconds, value.mtbf_seconds)
    age = value.time - started_at
    assert value.mtbf_seconds == pytest.approx(age / failures, rel=0.2)  # read up to 2 s before the choice


def test_auto_interval_follows_the_failure_history_and_re_estimates_after_a_failure(harness):
    port = harness.start_store()
    store = harness.client(port)
    started_at = time.time() - 60.0
    history = control.ReliabilityReport(started_at=started_at, failures=3)  # MTBF ~20 s
    store.set(control.RELIABILITY_KEY, history.model_dump_json())
    contract = harness.contract(global_batch=4, micro=1, max_steps=100_000, interval="auto", keep=1000)
    extra = {"DISTTRAIN_AGENT_ENDPOINT": f"127.0.0.1:{port}", "TOY_STEP_SLEEP": "0.02"}

    first = harness.start(2, contract, "calm", **extra)

    def three_saves_and_the_step_after() -> bool:  # the rule below reads the interval recorded one step later
        commits = committed_steps(harness)
        try:
            return len(commits) >= 3 and commits[2] + 1 in intervals_by_step(harness, "calm")
        except json.JSONDecodeError:  # a record line still being written
            return False

    harness.wait_until("three saves", three_saves_and_the_step_after, timeout=180)
    calm = report(store)
    harness.kill_tree(first.pid)  # the node is lost
    first.wait(timeout=30)
    check_report(calm, 3, started_at)
    before = committed_steps(harness)
    calm_agreed = intervals_by_step(harness, "calm")
    assert_saved_by_the_rule(before[:3], 0, calm_agreed)

    # The operator counts the loss (and the agent relays it): failures have become frequent.
    history = control.ReliabilityReport(started_at=started_at, failures=60)
    store.set(control.RELIABILITY_KEY, history.model_dump_json())
    resumed = before[-1]
    contract = harness.contract(global_batch=4, micro=1, max_steps=resumed + 60, interval="auto", keep=1000)
    rc, log = harness.run(2, contract, "stormy", timeout=180, **extra)
    assert rc == 0, log[-3000:]
    stormy = report(store)
    check_report(stormy, 60, started_at)
    assert stormy.mtbf_seconds < calm.mtbf_seconds / 10
    stormy_agreed = intervals_by_step(harness, "stormy")
    after = [c for c in committed_steps(harness) if c > resumed]
    assert len(after) >= 2 and after[-1] == resumed + 60  # the last step is always saved
    assert_saved_by_the_rule(after[:-1], resumed, stormy_agreed)
    calm_typical = statistics.median(v for v in calm_agreed.values() if v)
    stormy_typical = statistics.median(v for v in stormy_agreed.values() if v)
    # sqrt of a ~20x higher failure rate: a ~4.5x shorter interval (the save and step times vary on a busy machine)
    assert stormy_typical * 2 < calm_typical, (stormy_typical, calm_typical)
    assert math.isfinite(stormy.save_seconds) and stormy.save_seconds > 0
