"""The workers' debug mode (``spec.debug``): the environment and log files the launcher sets before workers start.

torch reads ``TORCH_DISTRIBUTED_DEBUG`` when ``torch.distributed`` is imported, so :func:`apply` runs in the
launcher's ``__main__`` before the warm interpreters start (they import torch at once). With ``DETAIL`` torch wraps
every process group in its ``ProcessGroupWrapper``, which exchanges a fingerprint of each collective (op, shapes,
dtypes) over a gloo side group before running it: ranks that call different collectives fail at once with "Detected
mismatch between collectives on ranks" (:mod:`disttrain.trainer.failures`), instead of hanging until the collective
timeout. NCCL reads ``NCCL_DEBUG*`` when a communicator is created; gloo ignores them.

Every variable the trainer container's env sets already is the user's and kept. Files go to one folder per launcher
start, ``<root>/debug/<node>/<UTC start time>-<unique>/``: pod names and container pids repeat across restarts, so
NCCL's ``%h.%p`` alone could overwrite an earlier pod's file. :func:`plan` is pure; :func:`apply` creates the folder
and edits the environment. Never imports torch (it runs before torch is imported).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Mapping, MutableMapping
from typing import Optional

from disttrain.api import env
from disttrain.api.contract import WorkerContract
from disttrain.api.spec import DebugSpec, DistributedDebugLevel, NcclDebugSubsystem

log = logging.getLogger("disttrain.launch")

DEBUG_FOLDER = "debug"
"""Folder under the checkpoint dir (else the temp dir) that holds every node's debug folders."""
NCCL_DEBUG_FILE = "nccl.%h.%p.log"
"""NCCL's per-process debug file; NCCL puts the host name for ``%h`` and the pid for ``%p``."""
LOGS_FOLDER = "logs"
"""torchrun's ``--log-dir`` inside the launcher's debug folder (it adds ``<run id>_<unique>/attempt_<n>/<rank>``)."""
TEE_ALL = "3"
"""torchrun's ``--tee`` value for stdout and stderr: copied to the files and still printed to the pod's log."""


@dataclasses.dataclass(frozen=True)
class DebugEnv:
    """What the launcher does to its environment: variables to set, and the user's that are kept."""

    to_set: dict[str, str]
    kept: dict[str, str]


def settings(debug: DebugSpec, folder: str) -> dict[str, str]:
    """Every variable debug mode sets, by name. ``folder``: the launcher's debug folder."""
    wanted: dict[str, str] = {}
    level = debug.distributed
    if level is not DistributedDebugLevel.OFF:
        wanted["TORCH_DISTRIBUTED_DEBUG"] = level.value
        wanted["TORCH_CPP_LOG_LEVEL"] = "INFO"  # c10d's own C++ log lines (group set-up, wrapper checks)
    if level is not DistributedDebugLevel.OFF or debug.nccl_subsystems:
        wanted["NCCL_DEBUG"] = "INFO"
        if debug.nccl_subsystems:
            wanted["NCCL_DEBUG_SUBSYS"] = ",".join(dict.fromkeys(s.value for s in debug.nccl_subsystems))
        wanted["NCCL_DEBUG_FILE"] = os.path.join(folder, NCCL_DEBUG_FILE)
    if debug.per_rank_logs:
        # torchrun starts a worker whose output goes to files cold anyway: prestarted interpreters would be wasted.
        wanted[env.WARM_WORKERS] = "0"
    wanted[env.DEBUG_DIR] = folder
    return wanted


def plan(debug: Optional[DebugSpec], folder: str, environ: Mapping[str, str]) -> DebugEnv:
    """The variables to set: :func:`settings` less those the environment already has (the user's win)."""
    if debug is None or not debug.is_on:
        return DebugEnv(to_set={}, kept={})
    wanted = settings(debug, folder)
    return DebugEnv(
        to_set={k: v for k, v in wanted.items() if k not in environ},
        kept={k: environ[k] for k in wanted if k in environ},
    )


def node_folder(root: str, node_name: str) -> str:
    """The node's debug folders: ``<root>/debug/<node>``; each launcher start makes its own inside it."""
    return os.path.join(root, DEBUG_FOLDER, node_name or "node")


def folder_prefix(started: float) -> str:
    """The start of a launcher's folder name, its UTC start time (``20261204T233000Z-``): the folders sort by it."""
    return time.strftime("%Y%m%dT%H%M%SZ-", time.gmtime(started))


def contract_debug(environ: Mapping[str, str]) -> Optional[DebugSpec]:
    """``spec.debug`` from the worker contract; None without a readable one (the trainer reports a bad contract)."""
    try:
        return WorkerContract.from_env_value(environ.get(env.CONTRACT, "")).debug
    except ValueError:
        return None


def apply(environ: MutableMapping[str, str]) -> Optional[DebugSpec]:
    """Set debug mode's variables in ``environ`` and create the launcher's debug folder: on the checkpoint volume
    (shared, outlives the pod) when it can be, else in the temp dir. Returns the job's debug spec (None: off)."""
    debug = contract_debug(environ)
    if debug is None or not debug.is_on:
        return None
    folder = _make_folder(environ)
    if folder is None:
        log.warning("debug mode: no folder for its files could be created; NCCL logs to stdout")
    debug_env = plan(debug, folder or "", environ)
    to_set = dict(debug_env.to_set)
    if folder is None:
        to_set.pop("NCCL_DEBUG_FILE", None)
        to_set.pop(env.DEBUG_DIR, None)
    environ.update(to_set)
    return debug


def describe(environ: Mapping[str, str]) -> str:
    """Debug mode's variables as the workers get them, for the launcher's log (its logging starts after
    :func:`apply`)."""
    return " ".join(f"{k}={environ[k]}" for k in sorted(NAMES) if k in environ)


def log_dir(environ: Mapping[str, str]) -> Optional[str]:
    """torchrun's ``--log-dir`` for per-rank logs, in the launcher's debug folder; None without one."""
    folder = environ.get(env.DEBUG_DIR)
    return os.path.join(folder, LOGS_FOLDER) if folder else None


def _make_folder(environ: Mapping[str, str]) -> Optional[str]:
    node = environ.get(env.NODE_NAME, "")
    roots = [environ.get(env.CHECKPOINT_DIR, ""), os.path.join(tempfile.gettempdir(), "disttrain")]
    for root in filter(None, roots):
        parent = node_folder(root, node)
        try:
            os.makedirs(parent, exist_ok=True)
            return tempfile.mkdtemp(prefix=folder_prefix(time.time()), dir=parent)
        except OSError as exc:
            log.warning("cannot create the debug folder under %s (%s)", parent, exc)
    return None


NAMES: frozenset[str] = frozenset(
    settings(
        DebugSpec(
            distributed=DistributedDebugLevel.DETAIL, nccl_subsystems=[NcclDebugSubsystem.INIT], per_rank_logs=True
        ),
        "",
    )
)
"""Every variable debug mode may set."""
