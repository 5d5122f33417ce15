"""OperatorMetrics: the restart budget as series, and reason series that exist before their first increment."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from disttrain.api import timestamps
from disttrain.operator import infralosses, losses
from disttrain.operator.metrics import (
    GOODPUT_CAUSES,
    INFRASTRUCTURE_REASONS,
    REFORM_REASONS,
    RESTART_REASONS,
    OperatorMetrics,
)

JOB = {"namespace": "team-a", "job": "demo"}


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {**JOB, **labels})


def test_the_restart_reasons_are_the_reconcile_cores_loss_reasons():
    assert set(RESTART_REASONS) == set(losses.LOSS_REASONS)
    assert set(REFORM_REASONS) == set(RESTART_REASONS) | {"ScaledDown", "ScaledUp", "NodeDeparting"}


def test_every_reason_series_exists_at_zero_from_the_first_sight():
    """increase() over [0, 1] counts the first restart; a series born at 1 would show none."""
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)
    metrics.observe_job("team-a", "demo", {"phase": "Running"}, now=100)
    for reason in RESTART_REASONS:
        assert _value(registry, "disttrain_job_restarts_total", reason=reason) == 0, reason
    for reason in REFORM_REASONS:
        assert _value(registry, "disttrain_job_reforms_total", reason=reason) == 0, reason
    assert _value(registry, "disttrain_job_reform_duration_seconds_count") == 0
    metrics.observe_job(
        "team-a",
        "demo",
        {
            "phase": "Reforming",
            "restarts": {"total": 1, "byReason": {"NodeNotReady": 1}},
            "reforms": 1,
            "lastReform": {"reason": "NodeNotReady", "start": "x"},
        },
        now=101,
    )
    assert _value(registry, "disttrain_job_restarts_total", reason="NodeNotReady") == 1
    assert _value(registry, "disttrain_job_reforms_total", reason="NodeNotReady") == 1
    assert _value(registry, "disttrain_job_restarts_total", reason="PodFailed") == 0


def test_the_restart_budget_and_the_restarts_counted_against_it():
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)
    metrics.observe_job(
        "team-a", "demo", {"restarts": {"total": 7, "byReason": {"PodFailed": 7}}}, now=1, max_restarts=8
    )
    assert _value(registry, "disttrain_job_max_restarts") == 8
    # A restarted operator: the counter starts at 0 again, the gauge still says what the status counts.
    assert _value(registry, "disttrain_job_restarts_total", reason="PodFailed") == 0
    assert _value(registry, "disttrain_job_restarts_counted") == 7


def test_infrastructure_losses_by_reason_the_last_hour_and_the_guard():
    """Beside the restart budget: a counter by reason, the window's count (at scrape time) and the spec's guard."""
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)
    metrics.observe_job("team-a", "demo", {"phase": "Running"}, now=1, max_infrastructure_losses_per_hour=20)
    for reason in INFRASTRUCTURE_REASONS:
        assert _value(registry, "disttrain_job_infrastructure_losses_total", reason=reason) == 0, reason
    assert _value(registry, "disttrain_job_max_infrastructure_losses_per_hour") == 20
    now = time.time()
    recent = [timestamps.format_time(now - infralosses.WINDOW_SECONDS - 5), timestamps.format_time(now - 5)]
    losses_now = {"total": 2, "byReason": {"HeartbeatLost": 1, "Evicted": 1}, "recent": recent}
    metrics.observe_job("team-a", "demo", {"infrastructureLosses": losses_now}, now=now)
    assert _value(registry, "disttrain_job_infrastructure_losses_total", reason="HeartbeatLost") == 1
    assert _value(registry, "disttrain_job_infrastructure_losses_total", reason="Evicted") == 1
    assert _value(registry, "disttrain_job_infrastructure_losses_last_hour") == 1, "the older loss left the window"
    assert _value(registry, "disttrain_job_restarts_total", reason="HeartbeatLost") == 0
    assert set(INFRASTRUCTURE_REASONS) == {r.value for r in infralosses.INFRASTRUCTURE_CAUSES}


def test_a_forgotten_job_leaves_no_series():
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)
    metrics.observe_job("team-a", "demo", {"phase": "Running", "lastCheckpoint": {"step": 5}}, now=1, max_restarts=3)
    metrics.forget_job("team-a", "demo")
    leftovers = [
        sample for family in registry.collect() for sample in family.samples if sample.labels.get("job") == "demo"
    ]
    assert leftovers == []


def test_every_operator_metric_is_documented():
    """docs/operator.md, the reference the README points to, names every series the operator exports."""
    from tests.conftest import REPO_ROOT

    registry = CollectorRegistry()
    OperatorMetrics(registry)
    names = {family.name + ("_total" if family.type == "counter" else "") for family in registry.collect()}
    text = (REPO_ROOT / "docs/operator.md").read_text()
    assert not [name for name in names if f"`{name}`" not in text]


def test_each_reform_phase_is_observed_once_per_reform():
    """The phase histogram (by namespace: a job's own phases are in its status) exists at 0 for every phase, then
    gets each phase of a completed reform, once; a deleted job leaves the namespace's figures alone."""
    from disttrain.operator.metrics import REFORM_PHASES

    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)
    metrics.observe_job("team-a", "demo", {"phase": "Running"}, now=100)
    for phase in REFORM_PHASES:
        assert phase_sample(registry, "count", phase) == 0, phase
    phases = dict.fromkeys(REFORM_PHASES, 0.5) | {"checkpointLoad": 2.0, "total": 5.5}
    done = {
        "phase": "Running",
        "reforms": 1,
        "lastReform": {"reason": "NodeNotReady", "start": "x", "durationSeconds": 5.0, "phases": phases},
    }
    metrics.observe_job("team-a", "demo", done, now=101)
    metrics.observe_job("team-a", "demo", done, now=102)  # the same reform seen again: not counted again
    assert phase_sample(registry, "count", "imports") == 1
    assert phase_sample(registry, "sum", "checkpointLoad") == 2.0
    assert phase_sample(registry, "count", "total") is None
    metrics.observe_job("team-a", "other", done, now=103)  # another job of the namespace: its reform counts too
    assert phase_sample(registry, "count", "imports") == 2
    metrics.forget_job("team-a", "demo")
    assert phase_sample(registry, "count", "imports") == 2
    assert registry.get_sample_value("disttrain_job_reform_phase_seconds_count", {**JOB, "phase": "imports"}) is None


def phase_sample(registry: CollectorRegistry, kind: str, phase: str) -> float | None:
    labels = {"namespace": "team-a", "phase": phase}
    return registry.get_sample_value(f"disttrain_job_reform_phase_seconds_{kind}", labels)


def test_each_agent_loss_counts_one_replacement():
    """status.agentLostAt set anew is one replacement; the same mark seen again, or cleared, is none."""
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)
    metrics.observe_job("team-a", "demo", {"phase": "Running"}, now=1)
    assert _value(registry, "disttrain_job_agent_replacements_total") == 0
    lost = {"phase": "Running", "agentLostAt": "2026-01-01T00:00:00Z"}
    metrics.observe_job("team-a", "demo", lost, now=2)
    metrics.observe_job("team-a", "demo", lost, now=3)
    metrics.observe_job("team-a", "demo", {"phase": "Running"}, now=4)
    assert _value(registry, "disttrain_job_agent_replacements_total") == 1
    metrics.observe_job("team-a", "demo", {"phase": "Running", "agentLostAt": "2026-01-01T00:05:00Z"}, now=5)
    assert _value(registry, "disttrain_job_agent_replacements_total") == 2
    assert _value(registry, "disttrain_job_restarts_counted") == 0


def test_the_goodput_counter_follows_the_status_by_cause():
    """From the first sight (series at 0) by what each cause grew; the ratio gauge is the status' ratio."""
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)

    def observe(training: float, detection: float, ratio: float) -> None:
        goodput = {"ratio": ratio, "seconds": {"training": training, "detection": detection, "bogus": 5.0}}
        metrics.observe_job("team-a", "demo", {"phase": "Running", "goodput": goodput}, now=1)

    observe(100.0, 0.0, 1.0)  # an operator that starts beside a running job: no increase yet
    assert all(_value(registry, "disttrain_job_goodput_seconds_total", cause=c) == 0 for c in GOODPUT_CAUSES)
    observe(130.0, 2.5, 0.98)
    observe(150.0, 2.5, 0.985)
    assert _value(registry, "disttrain_job_goodput_seconds_total", cause="training") == 50.0
    assert _value(registry, "disttrain_job_goodput_seconds_total", cause="detection") == 2.5
    assert _value(registry, "disttrain_job_goodput_seconds_total", cause="bogus") is None
    assert _value(registry, "disttrain_job_goodput_ratio") == 0.985
    metrics.forget_job("team-a", "demo")
    assert _value(registry, "disttrain_job_goodput_seconds_total", cause="training") is None
    assert _value(registry, "disttrain_job_goodput_ratio") is None
