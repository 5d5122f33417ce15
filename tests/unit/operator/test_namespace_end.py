"""Deleting a job's namespace is the job's end, not an RBAC fault: the operator's refused writes and its agent's
silence are not logged as warnings then."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from kubernetes import client as k8s
from prometheus_client import CollectorRegistry
from tests.unit.operator.world import job_manifest

from disttrain.api.spec import DistTrainJob
from disttrain.operator import handlers
from disttrain.operator.metrics import OperatorMetrics
from disttrain.operator.observed import Actions, Event

pytestmark = pytest.mark.timeout(30)

ENDING = "unable to create new content in namespace ml because it is being terminated"


def refusal(message: str) -> k8s.ApiException:
    error = k8s.ApiException(status=403, reason="Forbidden")
    error.body = json.dumps({"kind": "Status", "message": message})
    return error


class RefusingKube:
    def __init__(self, message: str) -> None:
        self.message, self.calls = message, 0

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        raise refusal(self.message)


def post(kube: RefusingKube) -> None:
    writer = handlers.Writer(kube, None, None)  # type: ignore[arg-type]
    job = DistTrainJob.model_validate(job_manifest(replicas=2))
    events = tuple(Event("Normal", f"Reason{i}", "message") for i in range(3))
    asyncio.run(handlers._post_events(writer, job, Actions(events=events), 0.0))


def test_events_refused_in_an_ending_namespace_are_not_warnings_and_not_retried(caplog):
    kube = RefusingKube(ENDING)
    with caplog.at_level(logging.DEBUG, logger="disttrain.operator"):
        post(kube)
    assert kube.calls == 1, "the namespace refuses every other event too"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_event_refused_by_rbac_is_still_a_warning(caplog):
    kube = RefusingKube('events is forbidden: User "system:serviceaccount:x:y" cannot create resource "events"')
    with caplog.at_level(logging.DEBUG, logger="disttrain.operator"):
        post(kube)
    assert kube.calls == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3 and warnings[0].startswith("could not post")


@pytest.mark.parametrize(("deleting", "level"), [(True, logging.DEBUG), (False, logging.WARNING)])
def test_a_silent_agent_is_a_warning_unless_its_job_is_being_deleted(caplog, deleting, level):
    metrics = OperatorMetrics(CollectorRegistry())
    operator = handlers.OperatorHandlers(lambda: None, metrics)  # type: ignore[arg-type, return-value]
    body = job_manifest(replicas=2)
    body["metadata"].update(uid="u1", resourceVersion="1")
    if deleting:
        body["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    operator.cache.put_job(body, 0.0)
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    wake = operator.pokes.get(namespace, name)  # what the job's loop waits on
    with caplog.at_level(logging.DEBUG, logger="disttrain.operator"):
        operator.agent_silent(namespace, name, "its pulse stopped")
    [record] = [r for r in caplog.records if "taken for lost" in r.getMessage()]
    assert record.levelno == level
    assert wake.is_set(), "the job is woken either way"
