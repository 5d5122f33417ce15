"""Pure builders of every Kubernetes object the operator creates for a job. No I/O, no kopf.

``build_worker_pod`` is the only definition of what a worker runs: the kube adapter posts its output and the
local runtime turns the same dict into a process (:func:`disttrain.operator.local.translate.to_process`).
Every object carries the job's labels and a controller ownerReference, so deleting the job garbage-collects
everything (on a real cluster; the kmock emulator has no garbage collector).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any, Optional

from disttrain.api import constants, containers, determinism, env
from disttrain.api import pulse as pulse_wire
from disttrain.api import spec as spec_module
from disttrain.api.contract import WorkerContract, job_checkpoint_dir
from disttrain.api.spec import DistTrainJob
from disttrain.operator import access, agentbeat, graceperiod, names, podsecurity, scheduling

# torchrun counts every worker-group failure (our drain and reform exits included) against --max-restarts;
# the operator owns the restart budget, so torchrun's must never run out.
# The launcher (trainer/launch/launcher.py) still ends the pod at the first failure of user code, with the user's
# exit code.
TORCHRUN_MAX_RESTARTS = 1_000_000
LAUNCHER = "disttrain.trainer.launch"
"""torchrun with the user's exit code (``python -m`` module of the trainer container's command)."""
TERMINATION_LOG = "/dev/termination-log"
CHECKPOINT_VOLUME = "disttrain-checkpoints"
METRICS_PORT = 9400
READY_PORT = 9399
"""The launcher listens here once the node's workers can start warm (``disttrain.trainer.launch.readiness``)."""
AGENT_IMAGE_REPOSITORY = "ghcr.io/disttrain/trainer"
AGENT_MEMORY = spec_module.AGENT_MEMORY
"""The agent's default memory limit (``spec.agent.resources.limits``; its size: ``disttrain.api.spec``)."""


def job_labels(job: DistTrainJob, role: str) -> dict[str, str]:
    return {constants.LABEL_JOB_NAME: job.metadata.name, constants.LABEL_ROLE: role}


def _metadata(job: DistTrainJob, name: str, role: str, extra_labels: Optional[dict[str, str]] = None) -> dict[str, Any]:
    labels = {**(extra_labels or {}), **job_labels(job, role)}
    return {
        "name": name,
        "namespace": job.metadata.namespace,
        "labels": labels,
        "ownerReferences": [access.owner_reference(job)],
    }


def agent_endpoint(job: DistTrainJob) -> str:
    """host:port of the agent's TCPStore as workers reach it through the agent Service."""
    host = f"{names.agent_service_name(job.metadata.name)}.{job.metadata.namespace}.svc"
    return f"{host}:{job.spec.rendezvous.port}"


def checkpoint_dir(job: DistTrainJob) -> str:
    """``$DISTTRAIN_CHECKPOINT_DIR`` of the job's worker pods."""
    return job_checkpoint_dir(job.spec.checkpoint.path, job.metadata.namespace, job.metadata.name)


def torchrun_args(job: DistTrainJob, endpoint: str) -> list[str]:
    """torchrun's arguments (everything between ``-m torch.distributed.run`` and the training command)."""
    spec = job.spec
    rdzv = spec.rendezvous
    conf = ",".join(
        [
            "is_host=false",  # the store lives in the agent pod: losing any worker never takes it down
            f"join_timeout={rdzv.join_timeout_seconds}",
            f"last_call_timeout={rdzv.last_call_timeout_seconds}",
            f"close_timeout={rdzv.close_timeout_seconds}",
            f"keep_alive_interval={rdzv.keep_alive_interval_seconds}",
            f"keep_alive_max_attempt={rdzv.keep_alive_max_attempts}",
            f"silent_after={rdzv.silent_after_seconds:g}",  # the launcher's beat period follows it in a large job
        ]
    )
    return [
        f"--nnodes={spec.nodes.min}:{spec.nodes.max}",
        f"--nproc-per-node={spec.nproc_per_node}",
        f"--rdzv-backend={constants.RDZV_BACKEND}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={job.metadata.uid or job.metadata.name}",
        f"--rdzv-conf={conf}",
        f"--max-restarts={TORCHRUN_MAX_RESTARTS}",
        "--no-python",
    ]


def worker_env(
    job: DistTrainJob,
    node_name: str,
    node_index: int,
    *,
    endpoint: Optional[str] = None,
    checkpoint_directory: Optional[str] = None,
    metrics_port: int = METRICS_PORT,
) -> list[dict[str, Any]]:
    """The DISTTRAIN_* contract env of one node (the local runtime overrides endpoint/dir/port)."""
    meta = job.metadata
    return [
        {"name": env.CONTRACT, "value": WorkerContract.from_spec(job.spec).to_env_value()},
        {"name": env.JOB_NAME, "value": meta.name},
        {"name": env.JOB_NAMESPACE, "value": meta.namespace},
        {"name": env.JOB_UID, "value": meta.uid or ""},
        {"name": env.NODE_NAME, "value": node_name},
        {"name": env.POD_UID, "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {"name": env.NODE_INDEX, "value": str(node_index)},
        {"name": env.CHECKPOINT_DIR, "value": checkpoint_directory or checkpoint_dir(job)},
        {"name": env.AGENT_ENDPOINT, "value": endpoint or agent_endpoint(job)},
        {"name": env.METRICS_PORT, "value": str(metrics_port)},
        {"name": env.READY_PORT, "value": str(READY_PORT)},
        # With a store shared between torchrun and the workers, a scale-up deadlocks when the running node keeps
        # rank 0: it never publishes MASTER_ADDR/PORT for the new round (see trainer/launch/rendezvous.py).
        {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"},
    ]


def metrics_ports(nproc_per_node: int) -> list[dict[str, Any]]:
    """One named container port per local rank's exporter (``DISTTRAIN_METRICS_PORT + LOCAL_RANK``): ``metrics``
    for rank 0, ``metrics-<rank>`` for the others, so a PodMonitor can keep exactly these by name."""
    return [
        {"name": "metrics" if rank == 0 else f"metrics-{rank}", "containerPort": METRICS_PORT + rank, "protocol": "TCP"}
        for rank in range(nproc_per_node)
    ]


def _is_metrics_port_name(name: str) -> bool:
    return name == "metrics" or (name.startswith("metrics-") and name[len("metrics-") :].isdigit())


def build_worker_pod(
    job: DistTrainJob,
    node_index: int,
    *,
    name: Optional[str] = None,
    endpoint: Optional[str] = None,
    checkpoint_directory: Optional[str] = None,
    avoid_nodes: Sequence[str] = (),
) -> dict[str, Any]:
    """Worker pod of node index ``node_index`` (named ``name``, by default ``<job>-worker-<index>``): the user's
    template plus our launcher, env, labels and volume; never scheduled on ``avoid_nodes`` (node affinity).

    The trainer container's ``command + args`` become the training command that torchrun runs with
    ``--no-python``; a container without a ``command`` is refused (the image entrypoint cannot be known here).
    The node index travels as the ``disttrain.dev/node-index`` label (for the operator) and as
    ``DISTTRAIN_NODE_INDEX`` (for the rendezvous handler, which orders ranks by it). The grace period between
    SIGTERM and SIGKILL, unless the template sets one, follows :mod:`disttrain.operator.graceperiod`.
    """
    name = name or names.worker_name(job.metadata.name, node_index)
    template = copy.deepcopy(job.spec.template)
    pod_spec: dict[str, Any] = template.get("spec") or {}
    pod_containers: list[dict[str, Any]] = pod_spec.setdefault("containers", [])
    trainer = pod_containers[containers.trainer_index(pod_containers)]
    user_command = [*(trainer.get("command") or []), *(trainer.get("args") or [])]
    if not trainer.get("command"):
        raise ValueError(
            f"spec.template.spec.containers[{trainer.get('name')}].command is required: the operator "
            "runs it under torchrun and cannot read the image's entrypoint"
        )
    endpoint = endpoint or agent_endpoint(job)
    trainer["command"] = ["python", "-m", LAUNCHER, *torchrun_args(job, endpoint), *user_command]
    trainer.pop("args", None)
    # The launcher writes the root cause of a failure here; the operator reads it from the container's status.
    termination_log = trainer.setdefault("terminationMessagePath", TERMINATION_LOG)
    reserved = constants.RESERVED_ENV_PREFIXES
    user_env = [e for e in trainer.get("env") or [] if not e.get("name", "").startswith(reserved)]
    trainer["env"] = [
        *object_store_env(job, user_env),
        *determinism.container_env(job.spec.training, {e.get("name", "") for e in user_env}),
        *worker_env(job, name, node_index, endpoint=endpoint, checkpoint_directory=checkpoint_directory),
        {"name": env.TERMINATION_LOG, "value": termination_log},
    ]
    ports = [p for p in trainer.get("ports") or [] if not _is_metrics_port_name(p.get("name", ""))]
    trainer["ports"] = [*ports, *metrics_ports(job.spec.nproc_per_node)]
    # Ready once the workers can start without import delay: the operator brings a node into a running group only
    # then, so the group never waits for a newcomer's imports. A probe of the user's own is kept.
    trainer.setdefault("readinessProbe", {"tcpSocket": {"port": READY_PORT}, "periodSeconds": 1})
    _mount_checkpoints(job, pod_spec, trainer)
    access.mount_store_secret(job, pod_spec, trainer)
    pod_spec["restartPolicy"] = "Never"  # a failed node is the operator's to replace, never the kubelet's
    pod_spec.setdefault("terminationGracePeriodSeconds", graceperiod.worker_grace_seconds(job.spec, job.status))
    pod_spec.setdefault("automountServiceAccountToken", False)  # the trainer never calls the API server
    podsecurity.apply_restricted_defaults(pod_spec)
    pod_spec["hostname"] = name
    pod_spec["subdomain"] = names.headless_service_name(job.metadata.name)
    if job.spec.run_policy.scheduler_name:
        pod_spec["schedulerName"] = job.spec.run_policy.scheduler_name
    if job.spec.run_policy.priority_class_name:
        pod_spec["priorityClassName"] = job.spec.run_policy.priority_class_name
    meta = _metadata(job, name, constants.ROLE_WORKER, (template.get("metadata") or {}).get("labels"))
    meta["labels"][constants.LABEL_NODE_INDEX] = str(node_index)
    meta["labels"][access.LABEL_JOB_UID] = job.metadata.uid or ""  # the NetworkPolicies select by it
    annotations = (template.get("metadata") or {}).get("annotations")
    if annotations:
        meta["annotations"] = dict(annotations)
    if avoid_nodes:
        _avoid_nodes(pod_spec, avoid_nodes)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}
    scheduling.apply_to_worker_pod(job, pod)  # Kueue's pod group, the gang scheduler's PodGroup and name
    return pod


def _avoid_nodes(pod_spec: dict[str, Any], nodes: Sequence[str]) -> None:
    """Add ``metadata.name NotIn [node]`` for each node to every required node-selector term of the template (terms
    are ORed, the requirements of one term ANDed), or one term with only them: the template's own placement rules
    still hold. One requirement per node: the API server refuses a node field selector with more than one value."""
    requirements = [{"key": "metadata.name", "operator": "NotIn", "values": [node]} for node in sorted(nodes)]
    affinity = pod_spec.setdefault("affinity", {}).setdefault("nodeAffinity", {})
    required = affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({})
    for term in terms:
        term.setdefault("matchFields", []).extend(dict(r, values=list(r["values"])) for r in requirements)


def _mount_checkpoints(job: DistTrainJob, pod_spec: dict[str, Any], trainer: dict[str, Any]) -> None:
    ckpt = job.spec.checkpoint
    volumes = pod_spec.setdefault("volumes", [])
    if ckpt.claim_name or ckpt.uri:
        volume = CHECKPOINT_VOLUME
        volumes[:] = [v for v in volumes if v.get("name") != volume]
        if ckpt.claim_name:
            volumes.append({"name": volume, "persistentVolumeClaim": {"claimName": ckpt.claim_name}})
        else:  # the local tier of an object store: the node's disk, gone with the pod (the bucket is what lasts)
            limit = {"sizeLimit": ckpt.local_tier_size_limit} if ckpt.local_tier_size_limit else {}
            volumes.append({"name": volume, "emptyDir": limit})
    else:
        volume = ckpt.volume_name or ""
        if not any(v.get("name") == volume for v in volumes):
            raise ValueError(f"spec.checkpoint.volumeName={volume!r} names no volume in spec.template.spec.volumes")
    mounts = [m for m in trainer.get("volumeMounts") or [] if m.get("mountPath") != ckpt.path]
    trainer["volumeMounts"] = [*mounts, {"name": volume, "mountPath": ckpt.path}]
    if not pod_spec["volumes"]:
        del pod_spec["volumes"]


OBJECT_STORE_CREDENTIALS: tuple[tuple[str, bool], ...] = (
    ("AWS_ACCESS_KEY_ID", False),
    ("AWS_SECRET_ACCESS_KEY", False),
    ("AWS_SESSION_TOKEN", True),
)
"""Keys of ``checkpoint.s3.credentialsSecret`` the trainer container gets as variables of the same names (name,
optional); the S3 SDK reads them from its environment."""


def object_store_env(job: DistTrainJob, user_env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trainer container's env with the credentials of ``checkpoint.s3.credentialsSecret`` (secretKeyRef): the
    user's own variables of those names give way. Without a Secret the env is the user's: the SDK then finds the
    pod's own identity (its variables, a web identity token, the node's role); the operator's never reaches a pod.
    Where the bucket is and how to address it travels in the worker contract (``checkpoint.uri`` and ``.s3``)."""
    ckpt = job.spec.checkpoint
    secret = ckpt.s3.credentials_secret if ckpt.uri and ckpt.s3 else None
    if not secret:
        return user_env
    names = {name for name, _ in OBJECT_STORE_CREDENTIALS}
    return [
        *(e for e in user_env if e.get("name") not in names),
        *(
            {
                "name": name,
                "valueFrom": {
                    "secretKeyRef": {"name": secret, "key": name, **({"optional": True} if optional else {})}
                },
            }
            for name, optional in OBJECT_STORE_CREDENTIALS
        ),
    ]


def trainer_container(pod: dict[str, Any]) -> dict[str, Any]:
    """The trainer container of a pod built here."""
    pod_containers: list[dict[str, Any]] = pod["spec"]["containers"]
    return pod_containers[containers.trainer_index(pod_containers)]


def agent_command(job: DistTrainJob) -> list[str]:
    return ["python", "-m", "disttrain.trainer.agent", "--port", str(job.spec.rendezvous.port)]


def default_agent_image() -> str:
    """The disttrain trainer image of this operator's own version (the chart passes its own choice instead)."""
    try:
        from importlib.metadata import version

        return f"{AGENT_IMAGE_REPOSITORY}:{version('disttrain')}"
    except Exception:  # noqa: BLE001 - not installed as a package: the repository's image, unpinned
        return f"{AGENT_IMAGE_REPOSITORY}:latest"


@dataclasses.dataclass(frozen=True)
class AgentSettings:
    """The operator's choices for every job agent (its ``--agent-*`` flags)."""

    image: Optional[str] = None
    """The agent's image (None: :func:`default_agent_image`)."""
    heartbeat_s: float = constants.AGENT_LEASE_RENEW_SECONDS
    """How often it renews its Lease (0: it has none)."""
    pulse_s: float = constants.AGENT_PULSE_SECONDS
    """How often it pulses (0: no pulse)."""
    pulse_key: bytes = dataclasses.field(default_factory=lambda: os.urandom(pulse_wire.KEY_BYTES), repr=False)
    """The operator's own key, from which each job's pulse key is derived (:func:`disttrain.api.pulse.job_key`):
    ``--agent-pulse-key-file``, or one of this process's own (then an operator started later cannot link to the
    agents this one created: it judges them by their Lease)."""

    def job_pulse_key(self, job: DistTrainJob) -> Optional[bytes]:
        """The pulse key of ``job``'s agent; None when agents do not pulse."""
        return pulse_wire.job_key(self.pulse_key, job.metadata.uid or "") if self.pulse_s > 0 else None


DEFAULT_AGENT = AgentSettings()
LOCAL_AGENT = AgentSettings(pulse_s=0)
"""Local mode's agents: no pulse, its runtime watches the agent's process itself."""


def build_agent_pod(
    job: DistTrainJob, settings: AgentSettings = DEFAULT_AGENT, avoid_nodes: Sequence[str] = ()
) -> dict[str, Any]:
    """The job agent: hosts the TCPStore, follows the job, relays progress.

    Its image is the operator's choice (``settings.image``, default :func:`default_agent_image`), never the user's
    template image: the agent holds a token that may patch the job's status, and no code of the user's image may
    run with it. Its placement and resources are ``spec.agent``'s alone: the template's nodeSelector, tolerations
    and affinity are the workers' (GPU nodes), and its securityContext is meant for the user's image, not the
    operator's (which runs as a non-root user); the agent gets the restricted defaults. The template's
    imagePullSecrets are kept: a private registry mirror usually serves the operator's image with the same secret.
    Never scheduled on ``avoid_nodes`` (node affinity, on top of ``spec.agent``'s). It renews its Lease every
    ``settings.heartbeat_s`` (0: it has none) and pulses every ``settings.pulse_s`` on its port named
    :data:`~disttrain.api.constants.AGENT_PULSE_PORT_NAME`, bound to its pod IP (0: no pulse).
    """
    template_spec = job.spec.template.get("spec") or {}
    placement = job.spec.agent
    name = names.agent_name(job.metadata.name)
    port = job.spec.rendezvous.port
    container: dict[str, Any] = {
        "name": constants.AGENT_CONTAINER,
        "image": settings.image or default_agent_image(),
        "command": agent_command(job),
        "env": [
            {"name": env.JOB_NAME, "value": job.metadata.name},
            {"name": env.JOB_NAMESPACE, "value": job.metadata.namespace},
            {"name": env.JOB_UID, "value": job.metadata.uid or ""},
        ],
        "ports": [{"name": "rendezvous", "containerPort": port, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 2},
        "resources": {k: v for k, v in placement.resources.to_wire().items() if v},
    }
    spec: dict[str, Any] = {
        "serviceAccountName": names.service_account_name(job.metadata.name),
        "restartPolicy": "Never",  # the operator replaces a failed agent and tells the workers to re-join
        "containers": [container],
    }
    if template_spec.get("imagePullSecrets"):
        spec["imagePullSecrets"] = copy.deepcopy(template_spec["imagePullSecrets"])
    heartbeat_s, pulse_s = settings.heartbeat_s, settings.pulse_s
    if heartbeat_s > 0 or pulse_s > 0:
        container["env"].append({"name": env.POD_UID, "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}})
    if heartbeat_s > 0:
        container["env"] += [
            {"name": env.AGENT_LEASE, "value": names.agent_lease_name(job.metadata.name)},
            {"name": env.AGENT_LEASE_RENEW_SECONDS, "value": f"{heartbeat_s:g}"},
        ]
    if pulse_s > 0:
        pulse = names.agent_pulse_port(job.spec.rendezvous.port)
        container["ports"].append({"name": constants.AGENT_PULSE_PORT_NAME, "containerPort": pulse, "protocol": "TCP"})
        container["env"] += [
            {"name": env.POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": env.AGENT_PULSE_PORT, "value": str(pulse)},
            {"name": env.AGENT_PULSE_SECONDS, "value": f"{pulse_s:g}"},
            {"name": env.AGENT_PULSE_KEY_FILE, "value": access.PULSE_KEY_FILE},
        ]
    _place_agent(placement, spec)
    if placement.avoid_workers:
        _prefer_no_workers(job, spec)
    if avoid_nodes:
        _avoid_nodes(spec, avoid_nodes)
    access.mount_store_secret(job, spec, container)
    podsecurity.apply_restricted_defaults(spec)  # it keeps its token: it watches its job and patches status
    meta = _metadata(job, name, constants.ROLE_AGENT, {access.LABEL_JOB_UID: job.metadata.uid or ""})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def _place_agent(placement: spec_module.AgentPlacementSpec, pod_spec: dict[str, Any]) -> None:
    """``spec.agent``'s nodeSelector, tolerations, affinity and priorityClassName, each only where it is set."""
    if placement.node_selector:
        pod_spec["nodeSelector"] = dict(placement.node_selector)
    if placement.tolerations:
        pod_spec["tolerations"] = [t.to_wire() for t in placement.tolerations]
    if placement.affinity:
        pod_spec["affinity"] = copy.deepcopy(placement.affinity)
    if placement.priority_class_name:
        pod_spec["priorityClassName"] = placement.priority_class_name


AVOID_WORKERS_WEIGHT = 100
"""Weight of the agent's preference for nodes without the job's workers (the highest the API server allows)."""


def _prefer_no_workers(job: DistTrainJob, pod_spec: dict[str, Any]) -> None:
    """A preferred anti-affinity to the job's worker pods by hostname, unless ``spec.agent.affinity`` has a
    podAntiAffinity of its own (the user's placement wins)."""
    affinity = pod_spec.setdefault("affinity", {})
    if "podAntiAffinity" in affinity:
        return
    term = {
        "labelSelector": {"matchLabels": job_labels(job, constants.ROLE_WORKER)},
        "topologyKey": "kubernetes.io/hostname",
    }
    affinity["podAntiAffinity"] = {
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": AVOID_WORKERS_WEIGHT, "podAffinityTerm": term}]
    }


def _service(job: DistTrainJob, name: str, role: str, port_name: str, port: int, **spec: Any) -> dict[str, Any]:
    """A Service of the job's pods of ``role`` with one TCP port; ``spec``: its other fields."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, name, role),
        "spec": {
            **spec,
            "selector": job_labels(job, role),
            "ports": [{"name": port_name, "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }


def build_agent_service(job: DistTrainJob) -> dict[str, Any]:
    name = names.agent_service_name(job.metadata.name)
    return _service(job, name, constants.ROLE_AGENT, "rendezvous", job.spec.rendezvous.port)


def build_headless_service(job: DistTrainJob) -> dict[str, Any]:
    """Stable DNS for worker pods (``<pod>.<job>-workers``), ready or not, for collectives between nodes."""
    name = names.headless_service_name(job.metadata.name)
    return _service(
        job, name, constants.ROLE_WORKER, "metrics", METRICS_PORT, clusterIP="None", publishNotReadyAddresses=True
    )


def build_service_account(job: DistTrainJob) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(job, names.service_account_name(job.metadata.name), constants.ROLE_AGENT),
    }


def build_role(job: DistTrainJob) -> dict[str, Any]:
    """The agent may read its own job, patch only its status, and renew its own Lease: nothing else, no other job."""
    only = [job.metadata.name]
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(job, names.role_name(job.metadata.name), constants.ROLE_AGENT),
        "rules": [
            {
                "apiGroups": [constants.GROUP],
                "resources": [constants.PLURAL],
                "resourceNames": only,
                "verbs": ["get", "watch"],
            },
            {
                "apiGroups": [constants.GROUP],
                "resources": [f"{constants.PLURAL}/status"],
                "resourceNames": only,
                "verbs": ["get", "patch"],
            },
            {
                "apiGroups": ["coordination.k8s.io"],
                "resources": ["leases"],
                "resourceNames": [names.agent_lease_name(job.metadata.name)],
                "verbs": ["patch"],
            },
        ],
    }


def build_agent_lease(job: DistTrainJob, heartbeat_s: float = constants.AGENT_LEASE_RENEW_SECONDS) -> dict[str, Any]:
    """The Lease the agent renews every ``heartbeat_s`` (:mod:`disttrain.operator.agentbeat`); created here, not by
    the agent, so that the agent may patch this one Lease and create none."""
    name = names.agent_lease_name(job.metadata.name)
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": _metadata(job, name, constants.ROLE_AGENT),
        "spec": {"leaseDurationSeconds": max(1, math.ceil(agentbeat.SILENT_RENEWALS * heartbeat_s))},
    }


def build_role_binding(job: DistTrainJob) -> dict[str, Any]:
    name = names.role_name(job.metadata.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(job, name, constants.ROLE_AGENT),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [
            {
                "kind": "ServiceAccount",
                "name": names.service_account_name(job.metadata.name),
                "namespace": job.metadata.namespace,
            }
        ],
    }


def build_support_objects(
    job: DistTrainJob,
    network: access.NetworkPolicySettings = access.DEFAULT_NETWORK,
    heartbeat_s: float = constants.AGENT_LEASE_RENEW_SECONDS,
) -> list[dict[str, Any]]:
    """Everything but pods and the store Secret (random: see handlers), in creation order (RBAC before the agent
    needs it; the NetworkPolicies, unless ``network`` turns them off, before the agent and workers listen; the
    agent's Lease unless ``heartbeat_s`` is 0)."""
    return [
        *access.build_network_policies(job, METRICS_PORT, network),
        build_service_account(job),
        build_role(job),
        build_role_binding(job),
        *([build_agent_lease(job, heartbeat_s)] if heartbeat_s > 0 else []),
        build_agent_service(job),
        build_headless_service(job),
    ]


def build_pod_group(job: DistTrainJob) -> Optional[dict[str, Any]]:
    """The PodGroup of ``spec.gang`` (Volcano or scheduler-plugins), owned by the job; None without a gang."""
    name = scheduling.pod_group_name(job)
    return scheduling.build_pod_group(job, _metadata(job, name, constants.ROLE_WORKER))
