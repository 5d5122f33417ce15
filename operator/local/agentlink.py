"""The local side of the job agent's file source (``python -m disttrain.trainer.agent --state-dir DIR``).

The runtime writes ``job.json``; the agent follows ``status.control`` from it and writes the status fields it
owns to ``agent-status.json`` (one writer per file), which the runtime merges into the status before each
reconcile, as the API server merges the agent's status patches on Kubernetes.
"""

from __future__ import annotations

import copy
from typing import Any

from disttrain.api import constants
from disttrain.api.status import AGENT_FIELDS
from disttrain.operator.local.statedir import StateDir


def localize_agent_pod(pod: dict[str, Any], state: StateDir, port: int) -> dict[str, Any]:
    """The agent pod's command, told to follow the state directory and listen on localhost only."""
    pod = copy.deepcopy(pod)
    container = pod["spec"]["containers"][0]
    container["command"] = [
        *container.get("command", []),
        *container.pop("args", []),
        "--state-dir",
        str(state.path),
        "--host",
        "127.0.0.1",
    ]
    return pod


def read_relayed(state: StateDir, cluster_checkpoint_dir: str = "") -> dict[str, Any]:
    """The agent's status fields (empty until it relayed anything).

    The agent names checkpoints and stall dumps by their path in the pod (under spec.checkpoint.path); local mode
    shows where they really are, in the state directory.
    """
    document = state.read_json(state.path / constants.LOCAL_AGENT_STATUS_FILE)
    if not isinstance(document, dict):
        return {}
    relayed = {k: v for k, v in document.items() if k in AGENT_FIELDS}

    def local(path: Any) -> Any:
        if cluster_checkpoint_dir and isinstance(path, str) and path.startswith(cluster_checkpoint_dir):
            return str(state.checkpoints_dir) + path[len(cluster_checkpoint_dir) :]
        return path

    ckpt = relayed.get("lastCheckpoint")
    if isinstance(ckpt, dict) and "path" in ckpt:
        relayed["lastCheckpoint"] = dict(ckpt, path=local(ckpt["path"]))
    stalled = relayed.get("stalledNodes")
    if isinstance(stalled, list):
        relayed["stalledNodes"] = [
            dict(entry, diagnostics=local(entry["diagnostics"]))
            if isinstance(entry, dict) and "diagnostics" in entry
            else entry
            for entry in stalled
        ]
    return relayed
