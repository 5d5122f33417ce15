"""Convert a Kubeflow PyTorchJob (kubeflow.org/v1, with or without ``elasticPolicy``) into a DistTrainJob.

Pure: a PyTorchJob object and the training contract in, a DistTrainJob (plus an HPA when the PyTorchJob asked
Kubeflow for one) and notes out. What carries over: the pod template (the ``pytorch`` container becomes
``trainer``, its torchrun launcher is stripped because the operator runs torchrun itself), Master + Worker
replicas and ``elasticPolicy`` min/max to the node range, ``nprocPerNode``, the rendezvous timeouts of
``rdzvConf``, the restart budget and the run policy. What PyTorchJob lacks, the training contract (batch, LR,
length, checkpoint storage), must come from the caller: :class:`Contract` lists what is missing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional, cast

from disttrain.api import constants

KUBEFLOW_API_VERSION = "kubeflow.org/v1"
KUBEFLOW_KIND = "PyTorchJob"
KUBEFLOW_CONTAINER = "pytorch"
"""Kubeflow requires this name for the training container."""

RDZV_CONF_KEYS = {
    "join_timeout": "joinTimeoutSeconds",
    "last_call_timeout": "lastCallTimeoutSeconds",
    "close_timeout": "closeTimeoutSeconds",
    "keep_alive_interval": "keepAliveIntervalSeconds",
    "keep_alive_max_attempt": "keepAliveMaxAttempts",
}
"""torchrun --rdzv-conf keys (as PyTorchJob's elasticPolicy.rdzvConf carries them) -> spec.rendezvous fields."""

TORCHRUN_FLAGS_WITHOUT_VALUE = {
    "--standalone",
    "--no-python",
    "--no_python",
    "--run-path",
    "--run_path",
    "-m",
    "--module",
    "--virtual-local-rank",
    "--virtual_local_rank",
}
TORCHRUN_MODULE_FLAGS = {"-m", "--module"}
TORCHRUN_NO_PYTHON_FLAGS = {"--no-python", "--no_python"}
NPROC_FLAGS = {"--nproc-per-node", "--nproc_per_node"}


@dataclass(frozen=True)
class Contract:
    """The training contract a PyTorchJob does not have, from the command line."""

    global_batch_size: Optional[int] = None
    micro_batch_size: Optional[int] = None
    lr: Optional[float] = None
    max_steps: Optional[int] = None
    max_samples: Optional[int] = None
    checkpoint_claim: Optional[str] = None
    checkpoint_volume: Optional[str] = None
    batch_policy: Optional[str] = None
    lr_scaling: Optional[str] = None
    checkpoint_path: Optional[str] = None
    checkpoint_interval_steps: Optional[int] = None
    seed: Optional[int] = None

    def missing(self) -> list[str]:
        """One line per required field that was not given: the DistTrainJob field and the flag that sets it."""
        lines = []
        if self.global_batch_size is None:
            lines.append("spec.training.globalBatchSize (--global-batch-size N): samples per optimizer step")
        if self.micro_batch_size is None:
            lines.append("spec.training.microBatchSize (--micro-batch-size N): samples per process per pass")
        if self.lr is None:
            lines.append("spec.training.lr.base (--lr X): learning rate at the global batch size")
        if (self.max_steps is None) == (self.max_samples is None):
            lines.append("spec.training.maxSteps or maxSamples (exactly one of --max-steps N, --max-samples N)")
        if (self.checkpoint_claim is None) == (self.checkpoint_volume is None):
            lines.append(
                "spec.checkpoint.claimName or volumeName (exactly one of --checkpoint-claim NAME, "
                "--checkpoint-volume NAME): where checkpoints are written, shared by every node"
            )
        return lines


@dataclass
class Conversion:
    """The result: the objects to apply (DistTrainJob first) and what the user should know."""

    objects: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class ConversionError(ValueError):
    """The input cannot become a DistTrainJob; the message says which field and why."""


def _int(value: Any, where: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError) as error:
        raise ConversionError(f"{where}: expected an integer, got {value!r}") from error


def split_launcher(command: list[str], notes: list[str]) -> tuple[list[str], Optional[int]]:
    """The training command without a torchrun launcher, and the --nproc-per-node the launcher gave (if any).

    ``torchrun [opts] script.py args`` and ``python -m torch.distributed.run [opts] script.py args`` become
    ``python script.py args``; ``--module`` (``-m``) gives ``python -m module args``; ``--no-python`` keeps the
    program as is. The operator adds its own torchrun with the rendezvous it hosts.
    """
    if command[:1] == ["torchrun"]:
        rest = command[1:]
    elif (
        len(command) >= 3
        and command[0].startswith("python")
        and command[1] == "-m"
        and command[2] in ("torch.distributed.run", "torch.distributed.launch")
    ):
        rest = command[3:]
    else:
        return command, None
    nproc: Optional[int] = None
    module = no_python = False
    dropped: list[str] = []
    index = 0
    while index < len(rest) and rest[index].startswith("-"):
        flag, _, inline = rest[index].partition("=")
        if flag in TORCHRUN_FLAGS_WITHOUT_VALUE:
            module |= flag in TORCHRUN_MODULE_FLAGS
            no_python |= flag in TORCHRUN_NO_PYTHON_FLAGS
            dropped.append(flag)
            index += 1
            continue
        value = inline if inline else (rest[index + 1] if index + 1 < len(rest) else "")
        index += 1 if inline else 2
        if flag in NPROC_FLAGS and value.isdigit():
            nproc = int(value)
        dropped.append(f"{flag}={value}")
    program = rest[index:]
    if not program:
        raise ConversionError("command: the torchrun launcher has no training script after its options")
    if dropped:
        notes.append(
            f"dropped the torchrun launcher options {' '.join(dropped)}: the operator runs torchrun "
            "with its own rendezvous, node range and nprocPerNode"
        )
    if no_python:
        return program, nproc
    return (["python", "-m", *program] if module else ["python", *program]), nproc


def _trainer_container(template: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    containers = template.get("spec", {}).get("containers") or []
    named = [c for c in containers if c.get("name") == KUBEFLOW_CONTAINER]
    if named:
        container = named[0]
    elif len(containers) == 1:
        container = containers[0]
    else:
        raise ConversionError(
            "pytorchReplicaSpecs.*.template.spec.containers: no container named 'pytorch' "
            "(Kubeflow's training container) and not exactly one container"
        )
    if container.get("name") != constants.TRAINER_CONTAINER:
        notes.append(f"container {container.get('name')!r} renamed to {constants.TRAINER_CONTAINER!r}")
        container["name"] = constants.TRAINER_CONTAINER
    return cast("dict[str, Any]", container)  # the template's own dict: the caller edits it in place


def _nproc(job_spec: dict[str, Any], container: dict[str, Any], launcher_nproc: Optional[int], notes: list[str]) -> int:
    elastic = job_spec.get("elasticPolicy") or {}
    declared = job_spec.get("nprocPerNode", elastic.get("nProcPerNode"))
    gpus = ((container.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu")
    if declared is None:
        return launcher_nproc or 1
    text = str(declared)
    if text.isdigit():
        return _int(text, "spec.nprocPerNode")
    if text in ("auto", "gpu") and gpus is not None:
        notes.append(f"nprocPerNode {text!r} -> {gpus} (the trainer container's nvidia.com/gpu limit)")
        return _int(gpus, "resources.limits['nvidia.com/gpu']")
    notes.append(f"nprocPerNode {text!r} has no fixed value here; set to 1 (edit spec.nprocPerNode)")
    return 1


def _rendezvous(elastic: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    rendezvous: dict[str, Any] = {}
    if elastic.get("rdzvPort"):
        rendezvous["port"] = _int(elastic["rdzvPort"], "spec.elasticPolicy.rdzvPort")
    for item in elastic.get("rdzvConf") or []:
        key, value = item.get("key"), item.get("value")
        if key in RDZV_CONF_KEYS:
            rendezvous[RDZV_CONF_KEYS[key]] = _int(value, f"spec.elasticPolicy.rdzvConf[{key}]")
        else:
            notes.append(f"rdzvConf {key}={value} has no DistTrainJob equivalent; dropped")
    backend = elastic.get("rdzvBackend")
    if backend and backend != "c10d":
        notes.append(f"rdzvBackend {backend!r} replaced: workers meet through c10d hosted by the job agent")
    for key in ("rdzvHost", "rdzvId"):
        if elastic.get(key):
            notes.append(f"elasticPolicy.{key} dropped: the job agent hosts the store and the job UID is the id")
    return rendezvous


def _run_policy(run: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    policy: dict[str, Any] = {}
    for key in ("cleanPodPolicy", "ttlSecondsAfterFinished", "activeDeadlineSeconds", "suspend"):
        if run.get(key) is not None:
            policy[key] = run[key]
    scheduling = run.get("schedulingPolicy") or {}
    if scheduling.get("priorityClass"):
        policy["priorityClassName"] = scheduling["priorityClass"]
    for key in ("queue", "minAvailable", "minResources", "scheduleTimeoutSeconds"):
        if scheduling.get(key) is not None:
            notes.append(
                f"runPolicy.schedulingPolicy.{key} ({scheduling[key]}) not carried over; see "
                "docs/operator.md for queueing and gang scheduling"
            )
    return policy


def _template(replicas: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    master, worker = replicas.get("Master"), replicas.get("Worker")
    source = worker or master
    if source is None or "template" not in source:
        raise ConversionError("spec.pytorchReplicaSpecs: needs a Worker or Master with a template")
    if master and worker and master.get("template") != worker.get("template"):
        notes.append(
            "Master and Worker templates differ; the Worker template is used for every node "
            "(in a DistTrainJob all nodes are equal and rank 0 may move)"
        )
    for role, spec in replicas.items():
        if role not in ("Master", "Worker"):
            raise ConversionError(f"spec.pytorchReplicaSpecs.{role}: only Master and Worker are known")
        if spec.get("restartPolicy") not in (None, "OnFailure", "ExitCode"):
            notes.append(
                f"pytorchReplicaSpecs.{role}.restartPolicy {spec['restartPolicy']} replaced by "
                "spec.restartPolicy (a restart budget for the whole job)"
            )
    template = copy.deepcopy(source["template"])
    pod = template.setdefault("spec", {})
    if pod.pop("restartPolicy", None) is not None:
        notes.append("template.spec.restartPolicy dropped: the operator sets it")
    return cast("dict[str, Any]", template)


def _nodes(job_spec: dict[str, Any], notes: list[str]) -> dict[str, int]:
    replicas = job_spec.get("pytorchReplicaSpecs") or {}
    total = sum(
        _int(spec.get("replicas", 1), f"spec.pytorchReplicaSpecs.{role}.replicas") for role, spec in replicas.items()
    )
    elastic = job_spec.get("elasticPolicy") or {}
    low = _int(elastic.get("minReplicas", total), "spec.elasticPolicy.minReplicas")
    high = _int(elastic.get("maxReplicas", total), "spec.elasticPolicy.maxReplicas")
    wanted = min(max(total, low), high)
    if wanted != total:
        notes.append(f"replicas {total} is outside elasticPolicy [{low}, {high}]; starting with {wanted}")
    return {"min": low, "max": high, "replicas": wanted}


def _env(container: dict[str, Any], notes: list[str]) -> None:
    env = container.get("env") or []
    kept = [e for e in env if not str(e.get("name", "")).startswith((*constants.RESERVED_ENV_PREFIXES, "PET_"))]
    for dropped in (e["name"] for e in env if e not in kept):
        notes.append(f"env {dropped} dropped: the operator sets the torchrun/disttrain environment")
    if env:
        container["env"] = kept
    if not kept:
        container.pop("env", None)


def _training(contract: Contract) -> dict[str, Any]:
    training: dict[str, Any] = {
        "globalBatchSize": contract.global_batch_size,
        "microBatchSize": contract.micro_batch_size,
        "lr": {"base": contract.lr},
    }
    if contract.lr_scaling:
        training["lr"]["scaling"] = contract.lr_scaling
    if contract.batch_policy:
        training["batchPolicy"] = contract.batch_policy
    if contract.max_steps is not None:
        training["maxSteps"] = contract.max_steps
    if contract.max_samples is not None:
        training["maxSamples"] = contract.max_samples
    if contract.seed is not None:
        training["seed"] = contract.seed
    return training


def _checkpoint(contract: Contract) -> dict[str, Any]:
    checkpoint: dict[str, Any] = {}
    if contract.checkpoint_claim:
        checkpoint["claimName"] = contract.checkpoint_claim
    if contract.checkpoint_volume:
        checkpoint["volumeName"] = contract.checkpoint_volume
    if contract.checkpoint_path:
        checkpoint["path"] = contract.checkpoint_path
    if contract.checkpoint_interval_steps:
        checkpoint["intervalSteps"] = contract.checkpoint_interval_steps
    return checkpoint


def _metadata(meta: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"name": meta.get("name")}
    if not out["name"]:
        raise ConversionError("metadata.name: required")
    if meta.get("namespace"):
        out["namespace"] = meta["namespace"]
    if meta.get("labels"):
        out["labels"] = dict(meta["labels"])
    annotations = {
        k: v
        for k, v in (meta.get("annotations") or {}).items()
        if k != "kubectl.kubernetes.io/last-applied-configuration"
    }
    if annotations:
        out["annotations"] = annotations
    return out


def _hpa(job: dict[str, Any], metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """Kubeflow creates an HPA from elasticPolicy.metrics; a DistTrainJob is scaled by a plain HPA on /scale."""
    meta = {k: v for k, v in job["metadata"].items() if k in ("name", "namespace")}
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": meta,
        "spec": {
            "scaleTargetRef": {"apiVersion": constants.API_VERSION, "kind": constants.KIND, "name": meta["name"]},
            "minReplicas": job["spec"]["nodes"]["min"],
            "maxReplicas": job["spec"]["nodes"]["max"],
            "metrics": copy.deepcopy(metrics),
        },
    }


def convert(pytorchjob: Any, contract: Contract) -> Conversion:
    """The DistTrainJob (and HPA) for one PyTorchJob object; ConversionError names what cannot be converted.

    The caller checks :meth:`Contract.missing` first: with fields missing the result would not be valid.
    """
    if not isinstance(pytorchjob, dict) or pytorchjob.get("kind") != KUBEFLOW_KIND:
        found = pytorchjob.get("kind") if isinstance(pytorchjob, dict) else type(pytorchjob).__name__
        raise ConversionError(f"kind: expected {KUBEFLOW_KIND}, got {found!r}")
    if pytorchjob.get("apiVersion") != KUBEFLOW_API_VERSION:
        raise ConversionError(f"apiVersion: expected {KUBEFLOW_API_VERSION}, got {pytorchjob.get('apiVersion')!r}")
    result = Conversion()
    notes = result.notes
    job_spec = pytorchjob.get("spec") or {}
    template = _template(job_spec.get("pytorchReplicaSpecs") or {}, notes)
    container = _trainer_container(template, notes)
    command = [*(container.get("command") or []), *(container.get("args") or [])]
    if not command:
        raise ConversionError(
            "template.spec.containers[pytorch]: no command (the image's entrypoint cannot be "
            "wrapped by torchrun); set command to the training script"
        )
    program, launcher_nproc = split_launcher(command, notes)
    container["command"] = program
    container.pop("args", None)
    _env(container, notes)
    elastic = job_spec.get("elasticPolicy") or {}
    spec: dict[str, Any] = {
        "template": template,
        "nodes": _nodes(job_spec, notes),
        "nprocPerNode": _nproc(job_spec, container, launcher_nproc, notes),
        "training": _training(contract),
        "checkpoint": _checkpoint(contract),
    }
    rendezvous = _rendezvous(elastic, notes)
    if rendezvous:
        spec["rendezvous"] = rendezvous
    run = job_spec.get("runPolicy") or {}
    max_restarts = elastic.get("maxRestarts", run.get("backoffLimit"))
    if max_restarts is not None:
        spec["restartPolicy"] = {"maxRestarts": _int(max_restarts, "spec.elasticPolicy.maxRestarts")}
    run_policy = _run_policy(run, notes)
    if run_policy:
        spec["runPolicy"] = run_policy
    job = {
        "apiVersion": constants.API_VERSION,
        "kind": constants.KIND,
        "metadata": _metadata(pytorchjob.get("metadata") or {}),
        "spec": spec,
    }
    result.objects.append(job)
    if elastic.get("metrics"):
        result.objects.append(_hpa(job, elastic["metrics"]))
        notes.append(
            "elasticPolicy.metrics -> an autoscaling/v2 HorizontalPodAutoscaler on the DistTrainJob's "
            "scale subresource (emitted after the job)"
        )
    return result
