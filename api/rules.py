"""Cross-field rules of a DistTrainJob, defined once for both the CRD (CEL) and ``disttrain validate`` (Python).

Each :class:`Rule` sits on a schema node (``spec.nodes`` ...) and carries its CEL expression, the Python
predicate that mirrors it on the same camelCase data (defaults applied, as the API server sees it), and one
message template rendered both as a CEL ``messageExpression`` and as a Python string. CEL rules only see
their own subtree, so each rule sits on the lowest node that sees all its fields,
and divisors are guarded because CEL still runs when a ``minimum`` fails.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from disttrain.api import constants, containers, storageuri
from disttrain.api.spec import data_degree

Node = dict[str, Any]


@dataclass(frozen=True)
class Rule:
    node: str
    """Dotted path of the schema node the rule is attached to ("" = the object root, ``name[*]`` = each item)."""
    cel: str
    """CEL expression that must hold."""
    message: str
    """printf-style message (only %d and %s), rendered with ``cel_args`` / ``args``."""
    cel_args: Sequence[str]
    """CEL expressions of the message arguments."""
    holds: Callable[[Any], bool]
    """Python mirror of ``cel`` on the node's data."""
    args: Callable[[Any], Sequence[Any]] = lambda node: ()
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

    def render(self, node: Node) -> str:
        return self.message % tuple(self.args(node))


def exactly_one_of(node: str, first: str, second: str) -> Rule:
    """The rule that exactly one of two optional fields of ``node`` is set."""
    short = node.rsplit(".", 1)[-1]
    return Rule(
        node=node,
        cel=f"has(self.{first}) != has(self.{second})",
        message=f"exactly one of {short}.{first} and {short}.{second} must be set",
        cel_args=(),
        holds=lambda n: (first in n) != (second in n),
    )


def _tensor_parallel(spec: Node) -> int:
    """``spec.training.mesh.tensorParallel``, 1 without it: the ranks that read the same samples."""
    return int((spec["training"].get("mesh") or {}).get("tensorParallel", 1))


def _data_ranks_per_node(spec: Node) -> int:
    """Ranks of one node that read different samples (:func:`disttrain.api.spec.data_degree` of a node)."""
    return data_degree(int(spec["nprocPerNode"]), _tensor_parallel(spec))


def _fixed_batch_divides(spec: Node) -> bool:
    training, replicas, nproc = spec["training"], spec["nodes"]["replicas"], spec["nprocPerNode"]
    micro, tp = training["microBatchSize"], _tensor_parallel(spec)
    if training["batchPolicy"] != "fixed" or replicas < 1 or nproc < 1 or micro < 1 or tp < 1 or nproc % tp:
        return True  # another rule reports the sizes themselves
    return bool(training["globalBatchSize"] % (micro * replicas * _data_ranks_per_node(spec)) == 0)


def _mesh_degree(spec: Node) -> tuple[str, int]:
    """The inner dimension of ``spec.training.mesh`` (its field name and degree); ("", 1) without a mesh."""
    mesh = spec["training"].get("mesh") or {}
    if "tensorParallel" in mesh:
        return "tensorParallel", mesh["tensorParallel"]
    if "shard" in mesh:
        return "shard", mesh["shard"]
    return "", 1


def _mesh_degree_divides_nproc(spec: Node) -> bool:
    _, degree = _mesh_degree(spec)
    return degree < 1 or spec["nprocPerNode"] % degree == 0


_TP_CEL = "(has(self.training.mesh) && has(self.training.mesh.tensorParallel) ? self.training.mesh.tensorParallel : 1)"
_MESH_DEGREE_CEL = (
    "(has(self.training.mesh.tensorParallel) ? self.training.mesh.tensorParallel : "
    "has(self.training.mesh.shard) ? self.training.mesh.shard : 1)"
)


CHECKPOINT_STORAGE_FIELDS = ("claimName", "volumeName", "uri")
"""Where checkpoints go: exactly one of these fields of ``spec.checkpoint``."""
_CHECKPOINT_STORAGE_CEL = " + ".join(f"(has(self.{k}) ? 1 : 0)" for k in CHECKPOINT_STORAGE_FIELDS) + " == 1"


def _only_with_uri(name: str) -> Callable[[Node], bool]:
    """The predicate that field ``name`` of ``spec.checkpoint`` is set only beside ``uri``."""
    return lambda checkpoint: name not in checkpoint or "uri" in checkpoint


def _checkpoint_volume_declared(spec: Node) -> bool:
    name = spec["checkpoint"].get("volumeName")
    if name is None:
        return True
    return any(v.get("name") == name for v in spec["template"].get("spec", {}).get("volumes", []))


def _trainer_has_command(pod_containers: list[Node]) -> bool:
    """The trainer container (when there is one: another rule requires it) has a non-empty command."""
    index = containers.find_trainer_index(pod_containers)
    return index is None or bool(pod_containers[index].get("command"))


AGENT_SERVICE_ACCOUNT_SUFFIX = "-agent"
"""Every job's agent runs as ServiceAccount ``<job>-agent`` (disttrain.operator.names), whose Role may patch that
job's status: a pod template naming any such account would run the user's code with that token, so names with this
suffix are refused in templates (the job name is unknown to a rule, and any job's account must be refused)."""


def agent_service_account_rule(field: str) -> Rule:
    """The rule refusing an agent's ServiceAccount in ``spec.template.spec.<field>`` (serviceAccount is the
    deprecated alias the API server still honours when serviceAccountName is unset)."""
    return Rule(
        node=f"spec.template.spec.{field}",
        cel=f"!self.endsWith('{AGENT_SERVICE_ACCOUNT_SUFFIX}')",
        message=(
            f"{field} %s is not allowed: names ending in '{AGENT_SERVICE_ACCOUNT_SUFFIX}' are reserved for job "
            "agents' ServiceAccounts (<job>-agent, which may patch a job's status); name another ServiceAccount "
            "or leave it unset"
        ),
        cel_args=("self",),
        holds=lambda name: not (isinstance(name, str) and name.endswith(AGENT_SERVICE_ACCOUNT_SUFFIX)),
        args=lambda name: (name,),
    )


def _silence_within_expiry(rdzv: Node) -> bool:
    silence, interval, attempts = (
        rdzv.get(k) for k in ("silentAfterSeconds", "keepAliveIntervalSeconds", "keepAliveMaxAttempts")
    )
    return silence is None or interval is None or attempts is None or bool(silence <= interval * attempts)


RULES: tuple[Rule, ...] = (
    Rule(
        node="spec.rendezvous",
        # has(): the API server checks the CRD's default (``rendezvous: {}``) against the rule with no nested defaults.
        cel=(
            "!has(self.silentAfterSeconds) || !has(self.keepAliveIntervalSeconds) || !has(self.keepAliveMaxAttempts) "
            "|| self.silentAfterSeconds <= double(self.keepAliveIntervalSeconds * self.keepAliveMaxAttempts)"
        ),
        message=(
            "rendezvous.silentAfterSeconds must be <= keepAliveIntervalSeconds x keepAliveMaxAttempts = %d, torch's "
            "expiry: beyond it torch drops the node first"
        ),
        cel_args=("self.keepAliveIntervalSeconds * self.keepAliveMaxAttempts",),
        holds=_silence_within_expiry,
        args=lambda n: (n["keepAliveIntervalSeconds"] * n["keepAliveMaxAttempts"],),
        field_path=".silentAfterSeconds",
    ),
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
            f"self.training.microBatchSize < 1 || {_TP_CEL} < 1 || self.nprocPerNode % {_TP_CEL} != 0 || "
            "self.training.globalBatchSize % "
            f"(self.training.microBatchSize * self.nodes.replicas * (self.nprocPerNode / {_TP_CEL})) == 0"
        ),
        message=(
            "globalBatchSize %d is not a multiple of microBatchSize*replicas*dataRanksPerNode = %d*%d*%d = %d "
            "(batchPolicy fixed; dataRanksPerNode is nprocPerNode / training.mesh.tensorParallel, the ranks of a "
            "node that read different samples)"
        ),
        cel_args=(
            "self.training.globalBatchSize",
            "self.training.microBatchSize",
            "self.nodes.replicas",
            f"self.nprocPerNode / {_TP_CEL}",
            f"self.training.microBatchSize * self.nodes.replicas * (self.nprocPerNode / {_TP_CEL})",
        ),
        holds=_fixed_batch_divides,
        args=lambda s: (
            s["training"]["globalBatchSize"],
            s["training"]["microBatchSize"],
            s["nodes"]["replicas"],
            _data_ranks_per_node(s),
            s["training"]["microBatchSize"] * s["nodes"]["replicas"] * _data_ranks_per_node(s),
        ),
        field_path=".training.globalBatchSize",
    ),
    exactly_one_of("spec.training", "maxSteps", "maxSamples"),
    exactly_one_of("spec.training.mesh", "shard", "tensorParallel"),
    Rule(
        node="spec",
        cel=f"!has(self.training.mesh) || {_MESH_DEGREE_CEL} < 1 || self.nprocPerNode % {_MESH_DEGREE_CEL} == 0",
        message=(
            "training.mesh.%s = %d must divide nprocPerNode = %d: the inner mesh dimension stays within a node, "
            "so every world size nodes x nprocPerNode splits into whole groups"
        ),
        cel_args=(
            "has(self.training.mesh.tensorParallel) ? 'tensorParallel' : 'shard'",
            _MESH_DEGREE_CEL,
            "self.nprocPerNode",
        ),
        holds=_mesh_degree_divides_nproc,
        args=lambda s: (*_mesh_degree(s), s["nprocPerNode"]),
        field_path=".training.mesh",
    ),
    Rule(
        node="spec.checkpoint",
        cel=_CHECKPOINT_STORAGE_CEL,
        message="exactly one of checkpoint.claimName, checkpoint.volumeName and checkpoint.uri must be set",
        cel_args=(),
        holds=lambda n: sum(1 for k in CHECKPOINT_STORAGE_FIELDS if k in n) == 1,
    ),
    Rule(
        node="spec.checkpoint",
        cel=f"!has(self.uri) || self.uri.matches('{storageuri.S3_URI_PATTERN}')",
        message=(
            "checkpoint.uri %s is not an s3://BUCKET/PREFIX URI (only s3:// is supported; bucket: 3-63 lower-case "
            "letters, digits, dots and hyphens; the prefix has no empty, . or .. segment)"
        ),
        cel_args=("self.uri",),
        holds=lambda n: "uri" not in n or re.match(storageuri.S3_URI_PATTERN, n["uri"]) is not None,
        args=lambda n: (n.get("uri"),),
        field_path=".uri",
    ),
    *(
        Rule(
            node="spec.checkpoint",
            cel=f"!has(self.{name}) || has(self.uri)",
            message=f"checkpoint.{name} applies only to a checkpoint.uri (an object store)",
            cel_args=(),
            holds=_only_with_uri(name),
            field_path=f".{name}",
        )
        for name in ("s3", "localTierSizeLimit")
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
            "has(self.spec) && (self.spec.containers.exists(c, c.name == 'trainer') || size(self.spec.containers) == 1)"
        ),
        message="template.spec.containers needs a container named 'trainer' (or exactly one container)",
        cel_args=(),
        holds=lambda t: containers.find_trainer_index(t.get("spec", {}).get("containers", [])) is not None,
        field_path=".spec",
    ),
    Rule(
        node="spec.template",
        cel=(
            "!has(self.spec) || (self.spec.containers.exists(c, has(c.name) && c.name == 'trainer') ? "
            "self.spec.containers.exists(c, has(c.name) && c.name == 'trainer' && has(c.command) && "
            "size(c.command) > 0) : "
            "size(self.spec.containers) != 1 || "
            "(has(self.spec.containers[0].command) && size(self.spec.containers[0].command) > 0))"
        ),
        message=(
            "the trainer container needs a command: the operator runs it under torchrun and cannot read the "
            "image's entrypoint"
        ),
        cel_args=(),
        holds=lambda t: _trainer_has_command(t.get("spec", {}).get("containers", [])),
        field_path=".spec.containers",
    ),
    Rule(
        node="spec.restartPolicy",
        # has() guards: the API server also evaluates rules on a schema's `default: {}` (nested defaults unapplied)
        cel=(
            "!has(self.backoffSeconds) || !has(self.maxBackoffSeconds) || self.backoffSeconds <= self.maxBackoffSeconds"
        ),
        message="restartPolicy.backoffSeconds must be <= restartPolicy.maxBackoffSeconds",
        cel_args=(),
        holds=lambda r: "maxBackoffSeconds" not in r or r.get("backoffSeconds", 0) <= r["maxBackoffSeconds"],
        field_path=".backoffSeconds",
    ),
    Rule(
        node="spec.restartPolicy.exitCodes",
        cel="!has(self.permanent) || !has(self.retryable) || self.permanent.all(c, !(c in self.retryable))",
        message="an exit code cannot be both permanent and retryable",
        cel_args=(),
        holds=lambda e: not set(e.get("permanent", ())) & set(e.get("retryable", ())),
        field_path=".retryable",
    ),
    Rule(
        node="spec.template.spec.containers[*]",
        cel=(
            "!has(self.env) || self.env.all(e, !e.name.startsWith('DISTTRAIN_') && !e.name.startsWith('TORCHELASTIC_'))"
        ),
        message="env names starting with DISTTRAIN_ or TORCHELASTIC_ are reserved: the operator sets them",
        cel_args=(),
        holds=lambda c: (
            not any(e.get("name", "").startswith(constants.RESERVED_ENV_PREFIXES) for e in c.get("env") or ())
        ),
        field_path=".env",
    ),
    agent_service_account_rule("serviceAccountName"),
    agent_service_account_rule("serviceAccount"),
    Rule(
        node="metadata.name",
        cel=f"size(self) <= {constants.MAX_JOB_NAME_LENGTH}",
        message=f"metadata.name must be at most {constants.MAX_JOB_NAME_LENGTH} characters (it prefixes pod and "
        "Service names), got %d",
        cel_args=("size(self)",),
        holds=lambda name: len(name) <= constants.MAX_JOB_NAME_LENGTH,
        args=lambda name: (len(name),),
    ),
    Rule(
        node="metadata.name",
        cel=f"self.matches('{constants.DNS_1035_LABEL}')",
        message="metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', starting with a "
        "letter; it names Services), got %s",
        cel_args=("self",),
        holds=lambda name: re.fullmatch(constants.DNS_1035_LABEL, name) is not None,
        args=lambda name: (name,),
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
    """The value at a dotted path of ``obj`` ("" = obj itself); None when absent (the first match of ``[*]``)."""
    found = list(nodes_at(obj, dotted))
    return found[0][1] if found else None


def nodes_at(obj: Any, dotted: str) -> Iterator[tuple[str, Any]]:
    """(concrete path, value) of every node matching ``dotted``; ``name[*]`` stands for each item of a list."""
    parts = [p for p in dotted.split(".") if p]

    def walk(value: Any, index: int, path: str) -> Iterator[tuple[str, Any]]:
        if index == len(parts):
            yield path, value
            return
        part = parts[index]
        key, each = (part[:-3], True) if part.endswith("[*]") else (part, False)
        if not isinstance(value, dict) or key not in value:
            return
        child, child_path = value[key], f"{path}.{key}" if path else key
        if not each:
            yield from walk(child, index + 1, child_path)
        elif isinstance(child, list):
            for position, item in enumerate(child):
                yield from walk(item, index + 1, f"{child_path}[{position}]")

    yield from walk(obj, 0, "")


def check_rules(obj: Node, rules: Sequence[Rule] = RULES) -> list[RuleViolation]:
    """Every violated (non-transition) rule on a whole DistTrainJob object in wire form."""
    violations = []
    for rule in rules:
        if rule.transition:
            continue
        for path, node in nodes_at(obj, rule.node):
            if not rule.holds(node):
                where = ".".join(p for p in (path, rule.field_path.lstrip(".")) if p)
                violations.append(RuleViolation(where, rule.render(node), rule))
    return violations


def rules_for(node: str) -> list[dict[str, Any]]:
    """The CEL entries (x-kubernetes-validations) of one schema node."""
    return [rule.to_cel() for rule in RULES if rule.node == node]
