"""A failed creation of any of the job's objects, as the adapter observed it, in the Created condition and one
Warning event; an object of the job's name held by another owner (an older job of the same name) is a wait."""

from __future__ import annotations

import dataclasses

import kopf
import pytest
from tests.unit.operator.world import World, job_manifest

from disttrain.operator import handlers
from disttrain.operator.metrics import OperatorMetrics
from disttrain.operator.observed import CreateFailure, Observed

pytestmark = pytest.mark.timeout(30)


class FailingWorld(World):
    """The world, with the adapter's memory of its last failed creation."""

    failure: CreateFailure | None = None

    def observed(self) -> Observed:
        return dataclasses.replace(super().observed(), create_failure=self.failure)


def test_a_failed_create_of_any_object_is_named_in_the_created_condition_and_one_event():
    world = FailingWorld(job_manifest(replicas=2))
    world.step()
    assert world.condition("Created")["status"] == "True"
    world.agent = None  # the adapter stopped at the failed RoleBinding: the agent pod was never created
    world.workers.clear()
    world.failure = CreateFailure("RoleBinding", "demo-agent", '403 Forbidden: rolebindings "demo-agent" is forbidden')
    actions = world.step(1)
    created = world.condition("Created")
    assert created["status"] == "False" and created["reason"] == "CreateFailed"
    assert "RoleBinding demo-agent" in created["message"] and "is forbidden" in created["message"]
    assert [(e.type, e.reason) for e in actions.events] == [("Warning", "CreateFailed")]
    assert "RoleBinding demo-agent" in actions.events[0].message
    assert actions.create_agent, "the creation is retried (the adapter paces it with its backoff)"
    assert not [e for e in world.step(1).events if e.type == "Warning"], "one event per answer"
    world.failure = CreateFailure("Service", "demo-workers", "500 Internal Server Error: etcd timeout")
    assert [e.reason for e in world.step(1).events] == ["CreateFailed"], "a new answer: a new event"
    world.failure = None
    actions = world.step(1)
    assert world.condition("Created")["status"] == "True"
    assert [e.reason for e in actions.events if e.reason == "Created"] == ["Created"]


def test_a_name_held_by_another_owner_is_a_wait_not_a_failure():
    world = FailingWorld(job_manifest(replicas=2))
    world.step()
    world.failure = CreateFailure(
        "Service", "demo-agent", "Service demo-agent already exists, owned by uid old", held_by="old"
    )
    actions = world.step(1)
    created = world.condition("Created")
    assert created["status"] == "False" and created["reason"] == "NameHeld"
    assert created["message"].startswith("waiting to create Service demo-agent")
    assert [e.reason for e in actions.events] == ["NameHeld"]
    assert world.status["phase"] not in ("Failed", "Succeeded")
    assert world.status.get("restarts", {}).get("total", 0) == 0


def test_the_operator_puts_no_finalizer_on_jobs():
    """No handler that makes kopf add a finalizer (a daemon, a timer, an on-delete handler): deleting a job must
    not wait for the operator. kopf still knows the old name, to remove it from jobs an older operator finalized."""
    registry = kopf.OperatorRegistry()
    handlers.register(registry, handlers.OperatorHandlers(lambda: None, OperatorMetrics()))  # type: ignore[arg-type,return-value]
    assert not registry._spawning.get_all_handlers()
    assert not any(h.requires_finalizer for h in registry._changing.get_all_handlers())
    settings = kopf.OperatorSettings()
    handlers.configure(settings)
    assert settings.persistence.finalizer == handlers.FINALIZER == "disttrain.dev/operator"
