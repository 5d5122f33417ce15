"""Turn a pod dict (as built for Kubernetes) into a local process: argv, environment, working directory.

The pod builders stay the single definition of what a node runs; only what differs between a cluster and one
machine is translated here:

* the agent Service's DNS name and port in args and env become ``127.0.0.1:<local port>`` (several jobs and
  tests share one machine, so the runtime picks a free port for each job's store);
* the checkpoint mount path becomes the state directory's ``checkpoints/``;
* ``DISTTRAIN_METRICS_PORT`` and ``DISTTRAIN_READY_PORT`` get free local ports per node (pods each have their own
  IP; processes do not);
* ``python``/``python3`` and ``torchrun`` resolve to the interpreter running disttrain (the image's
  interpreter on Kubernetes), so the venv's torch is used;
* ``env[].valueFrom.fieldRef`` is resolved from the local pod's name, namespace, uid and node.

Pure: no I/O; the runtime starts the result with :mod:`proctree`.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Optional, cast

from disttrain.api import containers
from disttrain.api import env as env_names


@dataclasses.dataclass(frozen=True)
class LocalSite:
    """Where the job lives on this machine."""

    agent_hosts: tuple[str, ...]
    """Host names the pods use for the agent (its Service, with or without the namespace/cluster suffix)."""
    cluster_port: int
    """spec.rendezvous.port: the store's port in the cluster."""
    local_port: int
    """The port the local agent listens on."""
    cluster_checkpoint_dir: str
    """DISTTRAIN_CHECKPOINT_DIR as the builder sets it (under spec.checkpoint.path)."""
    checkpoint_dir: str
    workdir: str
    python: str = sys.executable
    base_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Environment every local process starts from (the user's, so PATH and the venv work as in an image)."""
    rdzv_backend: Optional[str] = None
    """torchrun rendezvous backend to use instead of the pod's (when its handler is not installed here)."""
    store_secret: str = ""
    """The job's store secret: what the mounted Secret holds on Kubernetes, given in the env here."""
    pulse_port: int = 0
    """Where the local agent serves its pulse (0: it has none)."""
    pulse_key_file: str = ""
    """The file holding the job's pulse key: what the mounted Secret holds on Kubernetes."""


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    per_pod: frozenset[str] = frozenset()
    """Variables whose value is the pod's own (``valueFrom.fieldRef``: its name, uid, node): they differ from pod to
    pod of one job."""


def trainer_container(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    """The container the local process runs: the trainer of a worker pod, the only one of the agent pod."""
    pod_containers: list[Mapping[str, Any]] = pod.get("spec", {}).get("containers", [])
    index = containers.find_trainer_index(pod_containers)
    if index is None:
        raise ValueError(f"pod {pod.get('metadata', {}).get('name')!r}: {containers.NO_TRAINER_MESSAGE}")
    return pod_containers[index]


def _endpoint_pattern(site: LocalSite) -> re.Pattern[str]:
    hosts = "|".join(re.escape(h) for h in sorted(site.agent_hosts, key=len, reverse=True))
    return re.compile(rf"(?<![\w.-])(?:{hosts})(?::{site.cluster_port})?(?![\w-])")


def translate_text(text: str, site: LocalSite) -> str:
    """Agent host[:port] -> 127.0.0.1:<local port>; checkpoint dir -> the local one."""
    if site.cluster_checkpoint_dir and site.cluster_checkpoint_dir in text:
        text = text.replace(site.cluster_checkpoint_dir, site.checkpoint_dir)

    def endpoint(match: re.Match[str]) -> str:
        return f"127.0.0.1:{site.local_port}" if ":" in match.group(0) else "127.0.0.1"

    return _endpoint_pattern(site).sub(endpoint, text)


def translate_argv(argv: Sequence[str], site: LocalSite) -> list[str]:
    out = [translate_text(a, site) for a in argv]
    if out and out[0] in ("python", "python3", "python3.10", "python3.11", "python3.12", "python3.13"):
        out[0] = site.python
    elif out and out[0] == "torchrun":
        out[:1] = [site.python, "-m", "torch.distributed.run"]
    for i, arg in enumerate(out):
        if arg in ("python", "python3") and i > 0:
            out[i] = site.python
        elif i > 0 and arg == str(site.cluster_port) and out[i - 1] in ("--port", "--store-port", "--rdzv-port"):
            out[i] = str(site.local_port)
        elif re.fullmatch(rf"--(?:store-|rdzv-)?port={site.cluster_port}", arg):
            out[i] = arg.rsplit("=", 1)[0] + f"={site.local_port}"
        elif site.rdzv_backend and arg.startswith(("--rdzv-backend=", "--rdzv_backend=")):
            out[i] = arg.split("=", 1)[0] + f"={site.rdzv_backend}"
    return out


def _field_value(path: str, pod: Mapping[str, Any], node_name: str) -> Optional[str]:
    meta = pod.get("metadata", {})
    if path == "metadata.name":
        return cast(Optional[str], meta.get("name"))
    if path == "metadata.namespace":
        return cast(str, meta.get("namespace", "default"))
    if path == "metadata.uid":
        return cast(Optional[str], meta.get("uid", meta.get("name")))
    if path in ("status.podIP", "status.hostIP"):
        return "127.0.0.1"
    if path == "spec.nodeName":
        return node_name
    if path == "spec.serviceAccountName":
        return cast(str, pod.get("spec", {}).get("serviceAccountName", "default"))
    match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if match:
        return cast(Optional[str], meta.get(match.group(1), {}).get(match.group(2)))
    return None


def container_env(container: Mapping[str, Any], pod: Mapping[str, Any], node_name: str) -> dict[str, str]:
    """The container's env list resolved to plain strings (``$(VAR)`` references expanded as kubelet does)."""
    resolved: dict[str, str] = {}
    for item in container.get("env", []) or []:
        name = item.get("name")
        if not name:
            continue
        if "value" in item:
            value = str(item["value"])
            value = re.sub(r"\$\((\w+)\)", lambda m: resolved.get(m.group(1), m.group(0)), value)
            resolved[name] = value
            continue
        field = (item.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
        if field:
            field_value = _field_value(field, pod, node_name)
            if field_value is not None:
                resolved[name] = field_value
    return resolved


def to_process(
    pod: Mapping[str, Any], site: LocalSite, node_name: str, metrics_port: int, ready_port: int = 0
) -> ProcessSpec:
    """The local process for ``pod``: the trainer container's command and env, translated to this machine
    (``ready_port``: where its launcher signals readiness, the local stand-in for the pod's readinessProbe)."""
    container = trainer_container(pod)
    argv = translate_argv([*container.get("command", []), *container.get("args", [])], site)
    if not argv:
        raise ValueError(f"pod {pod.get('metadata', {}).get('name')!r}: the container has no command")
    env = dict(site.base_env)
    env.setdefault("OMP_NUM_THREADS", "1")  # many processes share a few cores locally
    env["PYTHONUNBUFFERED"] = "1"
    for name, value in container_env(container, pod, node_name).items():
        env[name] = translate_text(value, site)
    if env_names.AGENT_ENDPOINT in env:
        env[env_names.AGENT_ENDPOINT] = f"127.0.0.1:{site.local_port}"
    if env_names.CHECKPOINT_DIR in env or env_names.CONTRACT in env:
        env[env_names.CHECKPOINT_DIR] = site.checkpoint_dir
    if env_names.METRICS_PORT in env:
        env[env_names.METRICS_PORT] = str(metrics_port)
    if env_names.READY_PORT in env:
        env[env_names.READY_PORT] = str(ready_port)
    if env.pop(env_names.STORE_SECRET_FILE, None) is not None:  # no Secret volume here: the secret itself
        env[env_names.STORE_SECRET] = site.store_secret
    if env_names.AGENT_PULSE_PORT in env:
        env[env_names.AGENT_PULSE_PORT] = str(site.pulse_port)
    if env_names.AGENT_PULSE_KEY_FILE in env:
        env[env_names.AGENT_PULSE_KEY_FILE] = site.pulse_key_file
    workdir = container.get("workingDir")
    cwd = site.workdir if not workdir or not _exists(workdir) else workdir
    per_pod = frozenset(
        item["name"] for item in container.get("env", []) or [] if item.get("name") and "value" not in item
    )
    return ProcessSpec(tuple(argv), env, cwd, per_pod)


def _exists(path: str) -> bool:
    import os

    return os.path.isdir(path)
