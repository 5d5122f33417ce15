"""Validate DistTrainJob manifests the way the API server would, plus the plan rules it cannot express.

Order mirrors the API server: strict decoding (unknown fields), types/ranges/enums (pydantic), the pod
template against the Kubernetes schema, then the CEL rules (:mod:`disttrain.api.rules`, skipped when types
are wrong, as the server does), then the batch plan for every node count in range. Every problem is
collected, so one pass fixes the manifest. Each names the field path, what was wrong and what is allowed.
"""

from __future__ import annotations

import enum
import functools
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jsonschema
from pydantic import ValidationError

from disttrain.api import constants, crd, rules, yamlload
from disttrain.api import containers as containers_mod
from disttrain.api.fielderrors import field_errors, wire_path
from disttrain.api.plan import valid_node_counts
from disttrain.api.spec import DistTrainJob, GangScheduler

MAX_PRINTED_PROBLEMS = 50
"""Most problem lines printed for one file; the rest is counted ("... and N more"), so an alias-expanded list
cannot print megabytes of errors."""
MAX_LINE_CHARS = 400
"""Longest problem line printed (values quoted in a message are cut too)."""


class Severity(str, enum.Enum):
    ERROR = "error"
    WARNING = "warning"


@dataclass(frozen=True)
class Problem:
    path: str
    message: str
    severity: Severity = Severity.ERROR

    def __str__(self) -> str:
        prefix = "" if self.severity is Severity.ERROR else "warning: "
        return shorten(f"{prefix}{self.path}: {self.message}")


def shorten(text: str, limit: int = MAX_LINE_CHARS) -> str:
    """``text`` cut to ``limit`` characters with a visible "..." (a quoted 1 MiB value stays one short line)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def capped(lines: list[str], limit: int = MAX_PRINTED_PROBLEMS) -> list[str]:
    """The first ``limit`` lines, then one "... and N more problems" line for the rest."""
    if len(lines) <= limit:
        return lines
    return [*lines[:limit], f"... and {len(lines) - limit} more problems"]


INPUT_PARTS = ("<file>", "<yaml>")
"""Problem paths of a file refused before any object was read (size, encoding, YAML, limits)."""


class ManifestError(ValueError):
    """A manifest that cannot run; ``problems`` lists every error found (the message prints at most
    :data:`MAX_PRINTED_PROBLEMS`). A file refused as input is one line: ``<source>: <file>: <why>``."""

    def __init__(self, source: str, problems: list[Problem]) -> None:
        self.source = source
        self.problems = problems
        if len(problems) == 1 and problems[0].path in INPUT_PARTS:
            super().__init__(f"{source}: {problems[0]}")
            return
        lines = "\n".join(capped([f"  {p}" for p in problems]))
        super().__init__(f"{source}: invalid DistTrainJob:\n{lines}")


def _pydantic_problems(error: ValidationError) -> list[Problem]:
    return [Problem(path, message) for path, message in field_errors(error, "<root>", 100)]


def _strict(schema: Any) -> Any:
    """A copy of a structural schema that also refuses unknown fields (as kubectl's strict decoding does)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def _template_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(_strict(crd.pod_template_schema()))


@functools.cache
def _pod_spec_field_validator(field: str) -> jsonschema.Draft7Validator:
    """The Kubernetes schema of one PodSpec field, as the CRD gives it to a field marked with it (spec.agent)."""
    return jsonschema.Draft7Validator(_strict(crd.pod_template_schema()["properties"]["spec"]["properties"][field]))


def _agent_problems(spec: Any) -> list[Problem]:
    agent = spec.get("agent") if isinstance(spec, dict) else None
    affinity = agent.get("affinity") if isinstance(agent, dict) else None
    if not isinstance(affinity, dict):
        return []
    return _template_problems(affinity, _pod_spec_field_validator("affinity"), ("spec", "agent", "affinity"))


def _template_problems(
    template: Any,
    validator: jsonschema.Draft7Validator | None = None,
    prefix: tuple[str, ...] = ("spec", "template"),
) -> list[Problem]:
    problems = []
    validator = validator or _template_validator()
    for err in sorted(validator.iter_errors(template), key=lambda e: list(e.absolute_path)):
        path = wire_path((*prefix, *err.absolute_path))
        if err.validator == "additionalProperties":  # name each unknown field, as the API server's strict decoding
            known = set(err.schema.get("properties", {}))
            problems += [Problem(f"{path}.{key}", "unknown field") for key in sorted(err.instance) if key not in known]
        else:
            problems.append(Problem(path, err.message))
    return problems


def _plan_problems(job: DistTrainJob) -> list[Problem]:
    spec = job.spec
    counts = range(spec.nodes.min, spec.nodes.max + 1)
    valid = valid_node_counts(spec)
    if not valid:
        return [
            Problem(
                "spec.training.globalBatchSize",
                f"no node count in [{spec.nodes.min}, {spec.nodes.max}] can run globalBatchSize "
                f"{spec.training.global_batch_size} with microBatchSize {spec.training.micro_batch_size} and "
                f"nprocPerNode {spec.nproc_per_node} (batchPolicy fixed needs globalBatchSize divisible by "
                "microBatchSize x nodes x nprocPerNode)",
            )
        ]
    invalid = [n for n in counts if n not in valid]
    if not invalid:
        return []
    return [
        Problem(
            "spec.nodes",
            f"node counts {', '.join(map(str, invalid))} cannot divide globalBatchSize "
            f"{spec.training.global_batch_size}; the job only runs at {', '.join(map(str, valid))} nodes "
            "and leaves extra nodes idle",
            Severity.WARNING,
        )
    ]


def _gpu_problems(job: DistTrainJob, wire: dict[str, Any]) -> list[Problem]:
    """One process per GPU is the rule on GPUs: a trainer container whose ``nvidia.com/gpu`` limit differs from
    ``nprocPerNode`` leaves GPUs idle or puts two processes on one GPU (each rank takes ``cuda:LOCAL_RANK``)."""
    containers = wire.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or []
    index = containers_mod.find_trainer_index(containers)
    if index is None:
        return []
    limits = (containers[index].get("resources") or {}).get("limits") or {}
    gpus = limits.get(constants.GPU_RESOURCE)
    if gpus is None or str(gpus) == str(job.spec.nproc_per_node):
        return []
    return [
        Problem(
            "spec.nprocPerNode",
            f"nprocPerNode {job.spec.nproc_per_node} differs from the trainer container's "
            f"resources.limits[{constants.GPU_RESOURCE!r}] {gpus}; on GPUs run one process per GPU "
            f"(set nprocPerNode: {gpus})",
            Severity.WARNING,
        )
    ]


def _scheduling_problems(job: DistTrainJob) -> list[Problem]:
    """Queue and gang settings that cannot do what they seem to (docs/operator.md, "Queueing and gang scheduling")."""
    spec, problems = job.spec, []
    nodes = spec.nodes
    if job.metadata.labels.get(constants.KUEUE_QUEUE_LABEL) and nodes.min != nodes.max:
        problems.append(
            Problem(
                "spec.nodes",
                f"Kueue (label {constants.KUEUE_QUEUE_LABEL}) admits a pod group of a fixed size "
                f"(spec.nodes.replicas={nodes.replicas}): kubectl scale and an HPA cannot resize it within "
                f"[{nodes.min}, {nodes.max}]; resize by suspend, edit spec.nodes.replicas, resume",
                Severity.WARNING,
            )
        )
    gang = spec.gang
    if gang is not None and gang.queue and gang.scheduler is GangScheduler.SCHEDULER_PLUGINS:
        problems.append(
            Problem("spec.gang.queue", "is a Volcano setting; scheduler-plugins ignores it", Severity.WARNING)
        )
    if gang is not None and gang.schedule_timeout_seconds and gang.scheduler is GangScheduler.VOLCANO:
        problems.append(
            Problem(
                "spec.gang.scheduleTimeoutSeconds",
                "is a scheduler-plugins setting; Volcano ignores it",
                Severity.WARNING,
            )
        )
    return problems


def validate_object(obj: Any) -> list[Problem]:
    """Every problem of one DistTrainJob object (already parsed from YAML/JSON)."""
    if not isinstance(obj, dict):
        return [Problem("<root>", f"expected a mapping (a DistTrainJob object), got {type(obj).__name__}")]
    if obj.get("kind") != constants.KIND or obj.get("apiVersion") != constants.API_VERSION:
        found = f"{obj.get('apiVersion')!r}/{obj.get('kind')!r}"
        return [Problem("apiVersion/kind", f"expected {constants.API_VERSION}/{constants.KIND}, got {found}")]
    problems: list[Problem] = []
    template = obj.get("spec", {}).get("template") if isinstance(obj.get("spec"), dict) else None
    if isinstance(template, dict):
        problems += _template_problems(template)
    problems += _agent_problems(obj.get("spec"))
    try:
        job = DistTrainJob.model_validate(obj)
    except ValidationError as error:
        return problems + _pydantic_problems(error)
    if problems:  # the server skips CEL when the object is invalid; so do we
        return problems
    wire = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    problems += [Problem(v.path, v.message) for v in rules.check_rules(wire)]
    if not problems:
        problems += _plan_problems(job) + _gpu_problems(job, obj) + _scheduling_problems(job)
    return problems


def load_documents(path: pathlib.Path) -> Iterator[tuple[str, Any]]:
    """(source label, object) for every YAML document of a file. Read through :mod:`disttrain.api.yamlload`
    (size, encoding, alias expansion and depth bounded); every refusal is a one-line ManifestError."""
    try:
        docs = yamlload.load_file(path)
    except yamlload.ManifestInputError as error:
        raise ManifestError(str(path), [Problem(error.part, str(error))]) from None
    docs = [d for d in docs if d is not None]
    if not docs:  # kubectl: "error: no objects passed to apply"
        raise ManifestError(str(path), [Problem("<file>", "no objects in the file (expected a DistTrainJob)")])
    for index, doc in enumerate(docs):
        yield (f"{path}" if len(docs) == 1 else f"{path}#{index}"), doc


def load_job(path: pathlib.Path) -> DistTrainJob:
    """The single valid DistTrainJob in ``path``, or ManifestError listing every problem."""
    docs = list(load_documents(path))
    if len(docs) != 1:
        raise ManifestError(str(path), [Problem("<file>", f"expected exactly one DistTrainJob, found {len(docs)}")])
    source, obj = docs[0]
    errors = [p for p in validate_object(obj) if p.severity is Severity.ERROR]
    if errors:
        raise ManifestError(source, errors)
    return DistTrainJob.model_validate(obj)
