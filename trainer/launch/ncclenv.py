"""The NCCL environment the worker's launcher sets before torchrun: every value on purpose, every one overridable.

torch reads these variables when a worker creates its NCCL process group, and torchrun passes the launcher's
environment on to its workers (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` explicitly, with a default of its own: 1).
:func:`plan` decides, from the job's ``spec.elastic.collectiveTimeoutSeconds`` and the node's dump folder, which
variables to set; one the user set in the pod's env, under any name torch reads for the same setting, is kept.
docs/gpu.md gives the reason for each value. Pure: no I/O, no torch; the launcher applies the plan.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

ASYNC_ERROR_HANDLING_CLEANUP_ONLY = 2
"""ProcessGroupNCCL's ``CleanUpOnly``: on a failed or timed-out collective the watchdog aborts the communicators and
leaves the process alive, so the survivor's collective raises ``DistBackendError`` and the trainer re-forms in place.
torch's own default (3, ``SkipCleanUp``) and torchrun's (1, ``TearDown``) kill the process instead."""
DUMP_WAIT_MS = 5_000
"""``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``: how long the flight recorder's dump may take. The watchdog also sleeps
four times this after a timeout before it aborts the communicators, so it adds 4 x 5 s to every reform after a
collective timeout (torch's 15 s would add a minute). A dump of the ring buffer to a local file takes well under a
second; the slow part, symbolizing stack traces, is retried without them."""
REFORM_MARGIN_S = 60
"""Time a survivor has, after its collective raised, to leave its process group (the group's destruction stops
the heartbeat monitor); part of :func:`heartbeat_timeout_s`."""
FR_BUFFER_SIZE = 2_000
"""Flight recorder entries (one per collective, ring buffer): the last few steps even of an FSDP2 model with a few
hundred layers (three collectives per layer and step), a few MB per rank with stack traces."""
DUMP_FILE_NAME = "nccl_trace_rank_"
"""Prefix of the dump files in the node's folder; torch appends the global rank."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One NCCL setting: the variable the launcher sets, the other names torch reads for it, and its value."""

    name: str
    value: str
    aliases: tuple[str, ...] = ()
    """Older names of the same setting. torch reads the first name it finds (``name`` before these), so a user's
    value under an alias would lose to ours: an alias the user set keeps the setting theirs."""

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


@dataclasses.dataclass(frozen=True)
class NcclEnv:
    """What the launcher does to its environment: variables to set, and the user's that are kept."""

    to_set: dict[str, str]
    """Variables to add: ours where the user set none of a setting's names, the user's own value under the first
    name where they set only an alias."""
    kept: dict[str, str]
    """The user's variables that decide a setting instead of ours, by name."""


def heartbeat_timeout_s(collective_timeout_s: int, dump_wait_ms: int = DUMP_WAIT_MS) -> int:
    """``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``: after any rank's collective times out, every rank's heartbeat monitor
    dumps and then ends its process this long later, unless the process group was destroyed first. A survivor
    whose own collective started later times out up to one collective timeout after the first rank, its watchdog
    then waits four dump waits before it aborts, and it needs :data:`REFORM_MARGIN_S` to leave the group. The
    same value bounds a watchdog stuck in a CUDA call (torch's default: 8 minutes)."""
    return collective_timeout_s + 4 * -(-dump_wait_ms // 1000) + REFORM_MARGIN_S


def dump_prefix(folder: str) -> str:
    """The flight recorder's file prefix in ``folder`` (torch adds the rank: ``nccl_trace_rank_3``)."""
    return os.path.join(folder, DUMP_FILE_NAME)


def settings(collective_timeout_s: int, dump_folder: str, dump_wait_ms: int = DUMP_WAIT_MS) -> tuple[Setting, ...]:
    """Every NCCL setting the launcher makes, in the order docs/gpu.md explains them."""
    return (
        Setting(
            "TORCH_NCCL_ASYNC_ERROR_HANDLING",
            str(ASYNC_ERROR_HANDLING_CLEANUP_ONLY),
            aliases=("NCCL_ASYNC_ERROR_HANDLING",),
        ),
        Setting("TORCH_NCCL_ENABLE_MONITORING", "1"),
        Setting("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", str(heartbeat_timeout_s(collective_timeout_s, dump_wait_ms))),
        Setting("TORCH_FR_BUFFER_SIZE", str(FR_BUFFER_SIZE), aliases=("TORCH_NCCL_TRACE_BUFFER_SIZE",)),
        Setting("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
        Setting("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", str(dump_wait_ms)),
        Setting("TORCH_FR_DUMP_TEMP_FILE", dump_prefix(dump_folder), aliases=("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",)),
    )


def plan(collective_timeout_s: int, dump_folder: str, environ: Mapping[str, str]) -> NcclEnv:
    """The variables to set given the environment the launcher runs in.

    A setting the user made under an alias only is copied to the first name: torchrun would otherwise pass its own
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` to the workers, and torch reads the first name before the alias. The
    heartbeat timeout follows the dump wait in effect, the user's when they set one."""
    to_set: dict[str, str] = {}
    kept: dict[str, str] = {}
    for setting in settings(collective_timeout_s, dump_folder, _dump_wait_ms(environ)):
        user = [name for name in setting.names if name in environ]
        if not user:
            to_set[setting.name] = setting.value
            continue
        for name in user:
            kept[name] = environ[name]
        if setting.name not in environ:
            to_set[setting.name] = environ[user[0]]
    return NcclEnv(to_set=to_set, kept=kept)


def _dump_wait_ms(environ: Mapping[str, str]) -> int:
    """The user's ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC`` when it is a whole number of milliseconds, else ours."""
    try:
        return max(0, int(environ.get("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", DUMP_WAIT_MS)))
    except ValueError:
        return DUMP_WAIT_MS


def dump_folder(root: str, node_name: str) -> str:
    """This node's folder for flight recorder dumps: ``<root>/flight-recorder/<node name>``."""
    return os.path.join(root, "flight-recorder", node_name or "node")


NAMES: frozenset[str] = frozenset(name for setting in settings(60, "") for name in setting.names)
"""Every variable name of the settings: the launcher adds them after the first warm interpreters started, and torch
reads them when a group is created, not at import (:func:`disttrain.trainer.launch.warmstart.env_is_compatible`)."""
