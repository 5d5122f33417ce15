"""What the job agent reads of its DistTrainJob: a typed view of the spec, with the spec's defaults and no others.

The agent (:mod:`disttrain.trainer.agent`) reads five parts of the spec, each through the model of
:mod:`disttrain.api.spec` that defines it: ``rendezvous`` (the heartbeat rule of
:mod:`disttrain.trainer.agent.heartbeats`), ``checkpoint`` (the path it relays), ``reporting`` (how often it writes
progress), ``training`` (when training is complete) and ``elastic`` (the stall rule of
:mod:`disttrain.trainer.agent.stalls`). A field the job leaves out takes the spec model's default, the one the CRD
renders, so the agent, the operator and ``kubectl get -o yaml`` agree on every value. The rest of the spec (pod
template, nodes, restart policy) is the operator's and is not read here; unknown fields inside the parts read are
refused, as the spec refuses them.

A job the view cannot read raises :class:`SpecRefused`, which names every field that was wrong and how. Pure: no
I/O, and never torch, kopf or kubernetes (the ``disttrain.api`` rule).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ConfigDict, Field, ValidationError

from disttrain.api.fielderrors import field_errors
from disttrain.api.spec import (
    CheckpointSpec,
    ContractModel,
    ElasticSpec,
    ObjectMeta,
    RendezvousSpec,
    ReportingSpec,
    TrainingSpec,
)

MAX_VALUE_SHOWN = 80
"""Characters of an offending value quoted in a :class:`SpecRefused` message (a value may be large)."""


class AgentSpec(ContractModel):
    """The parts of :class:`~disttrain.api.spec.DistTrainJobSpec` the agent reads; each field is declared as the spec
    declares it (same model, same default or none), which ``tests/agent/test_spec_view.py`` checks."""

    model_config = ConfigDict(extra="ignore")

    rendezvous: RendezvousSpec = Field(default_factory=RendezvousSpec)
    """Heartbeat interval and attempts of the silence rule (``keepAliveIntervalSeconds`` x ``keepAliveMaxAttempts``)."""
    checkpoint: CheckpointSpec
    """Where checkpoints go: the relayed ``lastCheckpoint.path`` is under ``path``."""
    reporting: ReportingSpec = Field(default_factory=ReportingSpec)
    """How often progress is written into the status (Kubernetes only)."""
    training: TrainingSpec
    """The training length: reaching it is written into the status at once."""
    elastic: ElasticSpec = Field(default_factory=ElasticSpec)
    """The stall rule's settings (``stallFactor``, ``stallMinSeconds``); the rest of it is the operator's."""


class AgentJob(ContractModel):
    """The job as the agent reads it: who it is and :class:`AgentSpec`. Status is not part of it: the agent writes
    its own fields there and reads the operator's directive as it comes."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    metadata: ObjectMeta
    """Name, namespace and uid (the rest of the metadata is not read)."""
    spec: AgentSpec
    """The parts of the spec the agent reads."""

    @property
    def run_id(self) -> str:
        """torchrun's ``--rdzv-id`` as the pod builder sets it: the job's uid, else (local tests) its name."""
        return self.metadata.uid or self.metadata.name


class SpecRefused(ValueError):
    """The job cannot be read as :class:`AgentJob`; ``problems`` holds one ``path: what was wrong`` per field."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("the job agent cannot read this DistTrainJob: " + "; ".join(problems))


def parse_job(job: Mapping[str, Any]) -> AgentJob:
    """The typed view of ``job`` (wire form, as the API server or the local runtime holds it).

    Only ``metadata.name``, ``.namespace`` and ``.uid`` are taken from the metadata (managedFields and the rest
    change on every write and are not the agent's). Raises :class:`SpecRefused`."""
    try:
        return AgentJob.model_validate(view_input(job))
    except ValidationError as error:
        raise SpecRefused(describe(error)) from None


def view_input(job: Mapping[str, Any]) -> dict[str, Any]:
    """The part of ``job`` the view is made from: equal inputs make equal views (the agent parses once per change)."""
    meta = job.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    return {"metadata": {k: meta[k] for k in ("name", "namespace", "uid") if k in meta}, "spec": job.get("spec")}


def describe(error: ValidationError) -> list[str]:
    """One ``path: message`` line per error of ``error``, the path in wire names (``spec.rendezvous.port``)."""
    return [f"{path}: {message}" for path, message in field_errors(error, "<job>", MAX_VALUE_SHOWN)]
