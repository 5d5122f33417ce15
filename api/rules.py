"""Cross-field rules of a DistTrainJob, defined once for both the CRD (CEL) and ``disttrain validate`` (Python).

Each :class:`Rule` sits on a schema node (``spec.nodes`` ...) and carries its CEL expression, the Python
predicate that mirrors it on the same camelCase data (defaults applied, as the API server sees it), and one
message template rendered both as a CEL ``messageExpression`` and as a Python string. CEL rules only see
their own subtree, so each rule sits on the lowest node that sees all its fields,
and divisors are guarded because CEL still runs when a ``minimum`` fails.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from disttrain.api import constants

Node = dict[str, Any]


@dataclass(frozen=True)
class Rule:
    node: str
    """Dotted path of the schema node the rule is attached to ("" = the object root)."""
    cel: str
    """CEL expression that must hold."""
    message: str
    """printf-style message (only %d and %s), rendered with ``cel_args`` / ``args``."""
    cel_args: Sequence[str]
    """CEL expressions of the message arguments."""
    holds: Callable[[Node], bool]
    """Python mirror of ``cel`` on the node's data."""
    args: Callable[[Node], Sequence[Any]] = lambda node: ()
    """Python mirror of ``cel_args``."""
    field_path: str = ""
    """Relative path (".replicas") of the field the error is reported on; "" reports the node itself."""
    reason: str = ""
    """Kubernetes error reason (FieldValueForbidden ...); "" = FieldValueInvalid."""
    transition: bool = False
    """Uses oldSelf: checked by the API server on updates only."""

    def to_cel(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"rule": self.cel}
        if self.cel_args:
            escaped = self.message.replace("'", "\\'")
            entry["messageExpression"] = f"'{escaped}'.format([{', '.join(self.cel_args)}])"
        else:
            entry["message"] = self.message
        if self.field_path:
            entry["fieldPath"] = self.field_path
        if self.reason:
            entry["reason"] = self.reason
        return entry

    def error_path(self) -> str:
        return ".".join(p for p in (self.node, self.field_path.lstrip(".")) if p)

    def render(self, node: Node) -> str:
        return self.message % tuple(self.args(node))


def _fixed_batch_divides(spec: Node) -> bool:
    training, replicas, nproc = spec["training"], spec["nodes"]["replicas"], spec["nprocPerNode"]
    micro = training["microBatchSize"]
    if training["batchPolicy"] != "fixed" or replicas < 1 or nproc < 1 or micro < 1:
        return True
    return bool(training["globalBatchSize"] % (micro * replicas * nproc) == 0)


def _trainer_container_present(template: Node) -> bool:
    containers = template.get("spec", {}).get("containers", [])
    return any(c.get("name") == constants.TRAINER_CONTAINER for c in containers) or len(containers) == 1


def _checkpoint_volume_declared(spec: Node) -> bool:
    name = spec["checkpoint"].get("volumeName")
    if name is None:
        return True
    return any(v.get("name") == name for v in spec["template"].get("spec", {}).get("volumes", []))


RULES: tuple[Rule, ...] = (
    Rule(
        node="spec.nodes",
        cel="self.min <= self.max",
        message="nodes.min (%d) must be <= nodes.max (%d)",
        cel_args=("self.min", "self.max"),
        holds=lambda n: n["min"] <= n["max"],
        args=lambda n: (n["min"], n["max"]),
        field_path=".min",
    ),
    Rule(
        node="spec.nodes",
        cel="self.min <= self.replicas && self.replicas <= self.max",
        message="nodes.replicas must be within [%d, %d], got %d",
        cel_args=("self.min", "self.max", "self.replicas"),
        holds=lambda n: n["min"] <= n["replicas"] <= n["max"],
        args=lambda n: (n["min"], n["max"], n["replicas"]),
        field_path=".replicas",
    ),
    Rule(
        node="spec",
        cel=(
            "self.training.batchPolicy != 'fixed' || self.nodes.replicas < 1 || self.nprocPerNode < 1 || "
            "self.training.microBatchSize < 1 || self.training.globalBatchSize % "
            "(self.training.microBatchSize * self.nodes.replicas * self.nprocPerNode) == 0"
        ),
        message=(
            "globalBatchSize %d is not a multiple of microBatchSize*replicas*nprocPerNode = %d*%d*%d = %d "
            "(batchPolicy fixed)"
        ),
        cel_args=(
            "self.training.globalBatchSize",
            "self.training.microBatchSize",
            "self.nodes.replicas",
            "self.nprocPerNode",
            "self.training.microBatchSize * self.nodes.replicas * self.nprocPerNode",
        ),
        holds=_fixed_batch_divides,
        args=lambda s: (
            s["training"]["globalBatchSize"],
            s["training"]["microBatchSize"],
            s["nodes"]["replicas"],
            s["nprocPerNode"],
            s["training"]["microBatchSize"] * s["nodes"]["replicas"] * s["nprocPerNode"],
        ),
        field_path=".training.globalBatchSize",
    ),
    Rule(
        node="spec.training",
        cel="has(self.maxSteps) != has(self.maxSamples)",
        message="exactly one of training.maxSteps and training.maxSamples must be set",
        cel_args=(),
        holds=lambda t: ("maxSteps" in t) != ("maxSamples" in t),
    ),
    Rule(
        node="spec.checkpoint",
        cel="has(self.claimName) != has(self.volumeName)",
        message="exactly one of checkpoint.claimName and checkpoint.volumeName must be set",
        cel_args=(),
        holds=lambda c: ("claimName" in c) != ("volumeName" in c),
    ),
    Rule(
        node="spec",
        cel=(
            "!has(self.checkpoint.volumeName) || (has(self.template.spec) && has(self.template.spec.volumes) && "
            "self.template.spec.volumes.exists(v, v.name == self.checkpoint.volumeName))"
        ),
        message="checkpoint.volumeName %s is not a volume of template.spec.volumes",
        cel_args=("self.checkpoint.volumeName",),
        holds=_checkpoint_volume_declared,
        args=lambda s: (s["checkpoint"].get("volumeName"),),
        field_path=".checkpoint.volumeName",
    ),
    Rule(
        node="spec.template",
        cel=(
            "has(self.spec) && (self.spec.containers.exists(c, c.name == 'trainer') || "
            "size(self.spec.containers) == 1)"
        ),
        message="template.spec.containers needs a container named 'trainer' (or exactly one container)",
        cel_args=(),
        holds=_trainer_container_present,
        field_path=".spec",
    ),
    Rule(
        node="spec.restartPolicy",
        cel="self.backoffSeconds <= self.maxBackoffSeconds",
        message="restartPolicy.backoffSeconds must be <= restartPolicy.maxBackoffSeconds",
        cel_args=(),
        holds=lambda r: r["backoffSeconds"] <= r["maxBackoffSeconds"],
        field_path=".backoffSeconds",
    ),
    Rule(
        node="spec.restartPolicy.exitCodes",
        cel="self.permanent.all(c, !(c in self.retryable))",
        message="an exit code cannot be both permanent and retryable",
        cel_args=(),
        holds=lambda e: not set(e["permanent"]) & set(e["retryable"]),
        field_path=".retryable",
    ),
    Rule(
        node="",
        cel=f"size(self.metadata.name) <= {constants.MAX_JOB_NAME_LENGTH}",
        message=f"metadata.name must be at most {constants.MAX_JOB_NAME_LENGTH} characters (it prefixes pod and "
        "Service names), got %d",
        cel_args=("size(self.metadata.name)",),
        holds=lambda o: len(o["metadata"]["name"]) <= constants.MAX_JOB_NAME_LENGTH,
        args=lambda o: (len(o["metadata"]["name"]),),
        field_path=".metadata.name",
    ),
    Rule(
        node="",
        cel=(
            "!has(oldSelf.status) || !has(oldSelf.status.phase) || "
            "oldSelf.status.phase in ['Pending', 'Suspended', 'Succeeded', 'Failed'] || "
            "self.spec.training == oldSelf.spec.training"
        ),
        message="spec.training is immutable while the job is %s; suspend it first",
        cel_args=("oldSelf.status.phase",),
        holds=lambda o: True,
        field_path=".spec.training",
        reason="FieldValueForbidden",
        transition=True,
    ),
)


@dataclass(frozen=True)
class RuleViolation:
    path: str
    message: str
    rule: Rule = field(compare=False, repr=False)


def lookup(obj: Node, dotted: str) -> Any:
    """The value at a dotted path of ``obj`` ("" = obj itself); None when absent."""
    value: Any = obj
    for part in filter(None, dotted.split(".")):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def check_rules(obj: Node, rules: Sequence[Rule] = RULES) -> list[RuleViolation]:
    """Every violated (non-transition) rule on a whole DistTrainJob object in wire form."""
    violations = []
    for rule in rules:
        if rule.transition:
            continue
        node = lookup(obj, rule.node)
        if node is None:
            continue
        if not rule.holds(node):
            violations.append(RuleViolation(rule.error_path(), rule.render(node), rule))
    return violations


def rules_for(node: str) -> list[dict[str, Any]]:
    """The CEL entries (x-kubernetes-validations) of one schema node."""
    return [rule.to_cel() for rule in RULES if rule.node == node]
