"""Who may reach a job's store and workers: pure builders of the per-job Secret and NetworkPolicies, and the mount.

Two independent fences (docs/operator.md, "Who can reach the job agent and the workers"):

* the **store secret** (:mod:`disttrain.api.storeauth`): a Secret ``<job>-store-<uid>`` that only the job's pods mount;
  every value a process acts on is signed with it. This holds on every network plugin.
* two **NetworkPolicies**, where the network plugin enforces them: ``<job>-agent`` admits to the agent's store port
  only the job's worker pods, and to its pulse port only the operator's pods; ``<job>-workers`` admits to the
  workers the job's own pods on every port (torchrun's process-group store on rank 0 listens on a port torchrun
  picks at random, and so do gloo's and NCCL's peer sockets) and the metrics scraper on the exporters' ports. The
  process-group store's keys are read by torch's C++ and cannot be signed: this policy is what keeps a stranger
  away from them.

What a NetworkPolicy can and cannot prove: it selects pods by **labels**, and anyone who may create pods in the
job's namespace can give a pod the job's labels (the job's UID label included: it is no secret). A policy's pod
selector without a namespace selector only ever matches pods of the policy's own namespace, so a pod in another
namespace is never admitted by the job's labels. Inside the namespace, whoever may create pods may also mount the
job's Secret; the namespace is the trust boundary, as it is for Secrets. The operator never connects to a store or
a worker; the agent's policy admits it (``operator_namespace``, ``operator_pod_selector``) to the agent's pulse port
alone, which tells a caller nothing but that the agent lives. The kubelet's probes come from the node, which
NetworkPolicy cannot block. Egress stays open: the workers' egress is the user's (data, object stores, their own
services), and what reaches them in is what matters here.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
from collections.abc import Mapping
from typing import Any, Optional

from disttrain.api import constants, env, pulse, storeauth
from disttrain.api.spec import DistTrainJob
from disttrain.operator import names

VOLUME = "disttrain-store-secret"
MOUNT_PATH = "/var/run/secrets/disttrain.dev/store"
SECRET_FILE = f"{MOUNT_PATH}/{storeauth.SECRET_KEY}"
PULSE_KEY_FILE = f"{MOUNT_PATH}/{pulse.SECRET_KEY}"
"""The job's pulse key in the agent's container (the same Secret, :func:`build_store_secret`)."""


def owner_reference(job: DistTrainJob) -> dict[str, Any]:
    """Controller reference to the job: garbage collection deletes the object with the job."""
    return {
        "apiVersion": constants.API_VERSION,
        "kind": constants.KIND,
        "name": job.metadata.name,
        "uid": job.metadata.uid or "",
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(job: DistTrainJob, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": job.metadata.namespace,
        "labels": {constants.LABEL_JOB_NAME: job.metadata.name, constants.LABEL_ROLE: constants.ROLE_AGENT},
        "ownerReferences": [owner_reference(job)],
    }


def build_store_secret(job: DistTrainJob, secret: str, pulse_key: Optional[bytes] = None) -> dict[str, Any]:
    """The job's store secret, and its agent's pulse key when it pulses (created once: a repeated create is a 409
    and the first Secret stays; the pulse key is derived from the job's uid, so it is the same either way)."""
    encoded = base64.b64encode(secret.encode()).decode()
    data = {storeauth.SECRET_KEY: encoded}
    if pulse_key is not None:
        data[pulse.SECRET_KEY] = base64.b64encode(pulse_key.hex().encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(job, names.store_secret_name(job.metadata.name, job.metadata.uid or "")),
        "type": "Opaque",
        "immutable": True,
        "data": data,
    }


LABEL_JOB_UID = "disttrain.dev/job-uid"
"""The job's UID on every pod of the job: the policies select by it too, so the terminating pods of a deleted job
of the same name are neither selected nor admitted."""
PROMETHEUS_POD_SELECTOR: dict[str, Any] = {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
"""The Prometheus pods of prometheus-operator (the ServiceMonitor/PodMonitor convention of the chart)."""
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
"""The label the API server gives every namespace: its name (a namespace selector of exactly one namespace)."""
_SELECTOR_KEYS = frozenset({"matchLabels", "matchExpressions"})


@dataclasses.dataclass(frozen=True)
class NetworkPolicySettings:
    """The operator's ``--network-policy`` and metrics scraper selectors (the chart's ``networkPolicy`` values)."""

    enabled: bool = True
    scraper_namespace_selector: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Namespaces the scraper runs in (a LabelSelector; empty: every namespace)."""
    scraper_pod_selector: Mapping[str, Any] = dataclasses.field(default_factory=lambda: dict(PROMETHEUS_POD_SELECTOR))
    """The scraper's pods (a LabelSelector)."""
    operator_namespace: str = ""
    """The operator's own namespace: its pods are admitted to each agent's pulse port (empty: nobody is, and the
    operator judges agents by their Lease alone where the plugin enforces the policy)."""
    operator_pod_selector: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The operator's pods in that namespace (a LabelSelector; empty: every pod there)."""


DEFAULT_NETWORK = NetworkPolicySettings()
"""On, Prometheus pods of any namespace admitted to the metrics ports."""


def parse_label_selector(flag: str, text: str) -> dict[str, Any]:
    """A LabelSelector given as JSON on the command line; a ValueError names ``flag`` and what is wrong."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{flag}: not JSON ({error.msg} at character {error.pos}); expected a LabelSelector") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: a JSON {type(value).__name__}; expected an object (a LabelSelector)")
    unknown = sorted(set(value) - _SELECTOR_KEYS)
    if unknown:
        raise ValueError(f"{flag}: unknown keys {unknown}; a LabelSelector has only matchLabels and matchExpressions")
    labels = value.get("matchLabels", {})
    if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise ValueError(f"{flag}: matchLabels must map label names to string values")
    expressions = value.get("matchExpressions", [])
    if not isinstance(expressions, list) or not all(isinstance(e, dict) and "key" in e for e in expressions):
        raise ValueError(f"{flag}: matchExpressions must be a list of {{key, operator, values}} objects")
    return value


def worker_network_policy_name(job: str) -> str:
    return f"{job}-workers"


def pod_selector_labels(job: DistTrainJob, role: str) -> dict[str, str]:
    """The labels that select the job's pods of ``role``: name, role and UID (every pod of the job carries them)."""
    return {
        constants.LABEL_JOB_NAME: job.metadata.name,
        constants.LABEL_ROLE: role,
        LABEL_JOB_UID: job.metadata.uid or "",
    }


def _policy(job: DistTrainJob, name: str, role: str, ingress: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(job, name),
        "spec": {
            "podSelector": {"matchLabels": pod_selector_labels(job, role)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def build_network_policy(job: DistTrainJob, settings: NetworkPolicySettings = DEFAULT_NETWORK) -> dict[str, Any]:
    """Ingress to the agent pod: the job's worker pods (of this namespace: no namespace selector), only on the
    store's port; the operator's pods (``settings``), only on the pulse port."""
    workers = {"podSelector": {"matchLabels": pod_selector_labels(job, constants.ROLE_WORKER)}}
    ports = [{"protocol": "TCP", "port": job.spec.rendezvous.port}]
    ingress: list[dict[str, Any]] = [{"from": [workers], "ports": ports}]
    if settings.operator_namespace:
        operator = {
            "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: settings.operator_namespace}},
            "podSelector": copy.deepcopy(dict(settings.operator_pod_selector)),
        }
        pulse = [{"protocol": "TCP", "port": names.agent_pulse_port(job.spec.rendezvous.port)}]
        ingress.append({"from": [operator], "ports": pulse})
    return _policy(job, names.network_policy_name(job.metadata.name), constants.ROLE_AGENT, ingress)


def build_worker_network_policy(
    job: DistTrainJob, metrics_port: int, settings: NetworkPolicySettings = DEFAULT_NETWORK
) -> dict[str, Any]:
    """Ingress to the worker pods: the job's worker pods on every port (the process-group store, gloo and NCCL
    peers listen on ports chosen at run time), the metrics scraper on the exporters' ports
    (``metrics_port`` .. ``metrics_port + nproc_per_node - 1``)."""
    workers = {"podSelector": {"matchLabels": pod_selector_labels(job, constants.ROLE_WORKER)}}
    scraper = {
        "namespaceSelector": copy.deepcopy(dict(settings.scraper_namespace_selector)),
        "podSelector": copy.deepcopy(dict(settings.scraper_pod_selector)),
    }
    last = metrics_port + job.spec.nproc_per_node - 1
    metrics: dict[str, Any] = {"protocol": "TCP", "port": metrics_port}
    if last > metrics_port:
        metrics["endPort"] = last
    ingress = [{"from": [workers]}, {"from": [scraper], "ports": [metrics]}]
    return _policy(job, worker_network_policy_name(job.metadata.name), constants.ROLE_WORKER, ingress)


def build_network_policies(
    job: DistTrainJob, metrics_port: int, settings: NetworkPolicySettings = DEFAULT_NETWORK
) -> list[dict[str, Any]]:
    """The job's NetworkPolicies (none when ``settings.enabled`` is false)."""
    if not settings.enabled:
        return []
    return [build_network_policy(job, settings), build_worker_network_policy(job, metrics_port, settings)]


STORE_FRONT = "1"
"""``$DISTTRAIN_STORE_FRONT`` in every pod of a job: the agent serves its store behind its front, and clients relay.
``"0"`` (bench/store_front.py's runs without the front, nothing else) serves it bare."""


def mount_store_secret(job: DistTrainJob, pod_spec: dict[str, Any], container: dict[str, Any]) -> None:
    """Mount the job's store secret read-only into ``container`` and point ``$DISTTRAIN_STORE_SECRET_FILE`` at it
    (replacing anything of that name the template had), and tell its clients of the agent's store to go through a
    relay (``$DISTTRAIN_STORE_FRONT``, :mod:`disttrain.trainer.store.relay`)."""
    volumes = [v for v in pod_spec.get("volumes") or [] if v.get("name") != VOLUME]
    volumes.append(
        {"name": VOLUME, "secret": {"secretName": names.store_secret_name(job.metadata.name, job.metadata.uid or "")}}
    )
    pod_spec["volumes"] = volumes
    mounts = [m for m in container.get("volumeMounts") or [] if m.get("name") != VOLUME]
    container["volumeMounts"] = [*mounts, {"name": VOLUME, "mountPath": MOUNT_PATH, "readOnly": True}]
    secret_env = (env.STORE_SECRET_FILE, env.STORE_SECRET, env.STORE_FRONT)
    kept = [e for e in container.get("env") or [] if e.get("name") not in secret_env]
    front = {"name": env.STORE_FRONT, "value": STORE_FRONT}
    container["env"] = [*kept, {"name": env.STORE_SECRET_FILE, "value": SECRET_FILE}, front]
