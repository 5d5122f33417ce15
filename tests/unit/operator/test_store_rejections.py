"""What the job agent rejected in its store (``status.storeRejections``) becomes the
``disttrain_store_rejected_values_total`` counter and one summary Warning Event a minute, with a budget of its own."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from tests.unit.operator.world import T0, World, job_manifest

from disttrain.api import timestamps
from disttrain.operator import announcements, eventrate
from disttrain.operator.metrics import OperatorMetrics

pytestmark = pytest.mark.timeout(30)

JOB = {"namespace": "team-a", "job": "demo"}


def rejected(registry: CollectorRegistry, key_class: str, reason: str) -> float | None:
    return registry.get_sample_value(
        "disttrain_store_rejected_values_total", {**JOB, "key_class": key_class, "reason": reason}
    )


def rejections(counts: dict[str, int], recent: list[dict[str, str]] | None = None) -> dict:
    return {"storeRejections": {"total": sum(counts.values()), "counts": counts, "recent": recent or []}}


def test_the_counter_follows_the_agents_counts():
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)
    metrics.observe_job("team-a", "demo", {"phase": "Running"}, now=1)
    assert rejected(registry, "rendezvous", "unsigned") is None  # no series for a job never attacked
    metrics.observe_job("team-a", "demo", rejections({"rendezvous/unsigned": 2, "foreign/foreign": 40}), now=2)
    assert rejected(registry, "rendezvous", "unsigned") == 2
    assert rejected(registry, "foreign", "foreign") == 40
    metrics.observe_job("team-a", "demo", rejections({"rendezvous/unsigned": 3, "foreign/foreign": 40}), now=3)
    assert rejected(registry, "rendezvous", "unsigned") == 3
    # a restarted agent counts from 0 again: what it reports is all new
    metrics.observe_job("team-a", "demo", rejections({"control/deleted": 1, "foreign/foreign": 5}), now=4)
    assert rejected(registry, "foreign", "foreign") == 45
    assert rejected(registry, "control", "deleted") == 1


def test_labels_outside_the_closed_sets_mint_no_series():
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)
    metrics.observe_job("team-a", "demo", {"phase": "Running"}, now=1)
    metrics.observe_job(
        "team-a", "demo", rejections({"evil/label": 9, "control/evil": 9, "control/unsigned": True}), now=2
    )
    assert not [s for f in registry.collect() for s in f.samples if s.name.startswith("disttrain_store_")]


def test_a_forgotten_job_leaves_no_rejection_series():
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)
    metrics.observe_job("team-a", "demo", {"phase": "Running"}, now=1)
    metrics.observe_job("team-a", "demo", rejections({"control/unsigned": 1}), now=2)
    metrics.forget_job("team-a", "demo")
    assert rejected(registry, "control", "unsigned") is None


def running_world() -> World:
    return World(job_manifest(min=1, max=2, replicas=2)).running_world(2)


def warnings(world: World) -> list[str]:
    return [
        e.message for e in (world.last.events if world.last else ()) if e.reason == announcements.STORE_VALUE_REJECTED
    ]


def test_recent_rejections_are_summed_up_without_echoing_a_key_and_stale_ones_are_not():
    world = running_world()
    at = timestamps.format_time(world.now)
    world.status.update(
        rejections(
            {"control/unsigned": 1, "foreign/foreign": 3, "evil\nlabel/x": 5},
            [
                {"key": "~/disttrain/failure", "keyClass": "control", "reason": "unsigned", "time": at},
                {"key": "junk\\nFORGED", "keyClass": "foreign", "reason": "foreign", "time": at},
                {"key": "junk/1", "keyClass": "foreign", "reason": "foreign", "time": "2001-01-01T00:00:00Z"},
            ],
        )
    )
    world.step(1.0)
    messages = warnings(world)
    assert len(messages) == 1, messages
    assert "control/unsigned 1" in messages[0] and "foreign/foreign 3" in messages[0]
    assert "junk" not in messages[0] and "FORGED" not in messages[0] and "evil" not in messages[0]
    assert "~/disttrain/failure" not in messages[0], "keys stay in status, never in an Event"
    world.status.update(
        rejections({"foreign/foreign": 1}, [{"key": "x", "keyClass": "foreign", "reason": "foreign", "time": at}])
    )
    world.step(announcements.STORE_REJECTION_RECENT_SECONDS + 1)
    assert warnings(world) == []


def test_rejections_have_their_own_budget_and_never_crowd_out_the_jobs_warnings():
    """A fresh foreign key every 2 s for 10 min: one summary a minute, and the job's NodeLost still goes out."""
    event_filter = eventrate.EventFilter()
    posted = 0
    for second in range(0, 600, 2):
        message = f"the job agent rejected {second // 2 + 1} store value(s)"
        key = ("team-a", "demo", "Warning", announcements.STORE_VALUE_REJECTED, message)
        posted += event_filter.admit(key, float(second))
    assert posted == 10, "one summary per minute"
    for n in range(eventrate.BURST):
        assert event_filter.admit(("team-a", "demo", "Warning", "NodeLost", f"node {n} lost"), 600.0), n
    assert not event_filter.admit(("team-a", "demo", "Warning", "NodeLost", "one too many"), 600.0)


def test_status_with_rejections_is_valid_for_the_core():
    """The field is in the status model (the reconcile core reads it typed) and the agent owns it."""
    from disttrain.api.status import AGENT_FIELDS, DistTrainJobStatus

    assert "storeRejections" in AGENT_FIELDS
    status = DistTrainJobStatus.model_validate(
        rejections(
            {"control/unsigned": 1},
            [{"key": "~/x", "keyClass": "control", "reason": "unsigned", "time": "2024-01-01T00:00:00Z"}],
        )
    )
    assert status.store_rejections is not None and status.store_rejections.recent[0].key_class == "control"
    assert T0 > 0


@pytest.mark.parametrize(
    "bad",
    [
        {"total": "many"},
        {
            "total": 1,
            "counts": {"control/unsigned": 1},
            "recent": [{"key": "k" * 500, "keyClass": "control", "reason": "unsigned"}],
        },
        {"total": 1, "recent": [{"key": "k", "keyClass": "control", "reason": "unsigned", "time": "yesterday"}]},
        {"total": 1, "recent": [{"key": "k", "keyClass": "control", "reason": "unsigned"}] * 9},
    ],
    ids=["total-no-int", "key-too-long", "time-no-time", "too-many-recent"],
)
def test_a_malformed_report_is_dropped_before_the_core_reads_it(bad):
    """The operator does not take the agent's field on trust: one bad report must not fail every reconcile."""
    from disttrain.operator import agentfields

    clean, problems = agentfields.sanitize({"phase": "Running", "storeRejections": bad})
    assert "storeRejections" not in clean and problems and "storeRejections" in problems[0]
    good = rejections(
        {"control/unsigned": 1},
        [{"key": "~/x", "keyClass": "control", "reason": "unsigned", "time": "2024-01-01T00:00:00Z"}],
    )
    assert agentfields.sanitize({"phase": "Running", **good}) == ({"phase": "Running", **good}, [])
