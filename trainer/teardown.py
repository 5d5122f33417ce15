"""Leaving a process group in an in-place reform without blocking forever: abort or destroy, under a deadline.

A survivor leaves a group whose peer may be dead. ``destroy_process_group`` shuts each backend down cleanly; on NCCL
that waits for the communicator's pending work, which on a dead communicator never ends, and it has no timeout. So a
group with an NCCL backend is aborted (torch's ``_abort_process_group``: ``ncclCommAbort`` on every communicator,
local, no peer needed), and a gloo-only group is destroyed (see :func:`~disttrain.trainer.inplace.leave_groups`
for why gloo must be freed at once). Either way the teardown runs in a thread under :data:`LEAVE_DEADLINE_S`; one
that does not return in time ends the process with ``ExitCode.REFORM``, so the launcher restarts the worker instead
of the job hanging. torch releases the GIL in
``ProcessGroup.abort`` and ``shutdown``, so the waiting thread can still act on a teardown blocked in them.

Callers: :func:`disttrain.trainer.inplace.leave_groups`. Never used at the end of training
(:meth:`~disttrain.trainer.loop.ElasticTrainer.close`), where every peer is alive and leaves together.
"""

from __future__ import annotations

import contextlib
import enum
import faulthandler
import gc
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from disttrain.api.exitcodes import ExitCode
from disttrain.trainer import exits, groupsockets
from disttrain.trainer.launch import leaving

log = logging.getLogger("disttrain.trainer")

LEAVE_DEADLINE_S = 30.0
"""How long leaving a group may take before the worker gives up and exits ``REFORM``. An abort or a gloo destroy
returns within a second; the deadline stays below the launcher's ``REFORM_MARGIN_S`` (60 s,
:mod:`disttrain.trainer.launch.ncclenv`), the time NCCL's heartbeat monitor leaves a survivor to leave its group."""


class Teardown(enum.Enum):
    """How this process leaves its groups."""

    ABORT = "abort"
    """``_abort_process_group``: abort every communicator without waiting for its work (NCCL)."""
    DESTROY = "destroy"
    """``destroy_process_group``: shut down cleanly (gloo, whose connections close when the group is freed)."""


def choose(backend: str) -> Teardown:
    """The teardown for a default group of ``backend`` as ``dist.get_backend`` names it (``"gloo"``, ``"nccl"``,
    ``"cpu:gloo,cuda:nccl"``): destroy when every device's backend is gloo, abort otherwise (a communicator other
    than gloo's may be dead and block a clean shutdown)."""
    names = {part.rsplit(":", 1)[-1].strip().lower() for part in backend.split(",") if part.strip()}
    return Teardown.DESTROY if names == {"gloo"} else Teardown.ABORT


_RETIRED: list[dist.ProcessGroup] = []
"""Aborted process groups, kept referenced for the life of the process: an NCCL group's destructor waits for its
heartbeat monitor (its whole timeout after a dump signal) and would run under the GIL inside the garbage collector,
where no deadline of ours can fire. An aborted group holds no communicator work; keeping the object costs a few KB
per reform."""

_ABORTED = threading.Event()
"""Set once this process aborted its communicators (the reform directive), until it joins the next group."""
_ABORTED_ONCE = threading.Event()
"""Set once this process ever aborted its communicators (fault injection hangs only before that)."""


def abort_groups() -> None:
    """Abort every process group of this process (the caller dropped its own references); they are kept in
    :data:`_RETIRED`, never destroyed under the garbage collector."""
    if dist.is_initialized():
        _RETIRED.extend(distributed_c10d._world.pg_map)
        distributed_c10d._abort_process_group()


def abort_communicators() -> int:
    """Abort the NCCL communicators of every process group now, from a thread that is not blocked (the watchdog's,
    on the reform directive): a kernel spinning on a dead peer returns, the training thread's device wait or collective
    ends, and the step's error state reads aborted (:mod:`disttrain.trainer.gate`). The groups stay registered; the
    training thread leaves them as usual. Gloo has nothing to abort (its blocked receive is not interrupted: it fails
    when the peer's connection closes or at the collective timeout), so the groups' connections are shut down
    (:mod:`disttrain.trainer.groupsockets`): this process's blocked receive ends, and its peers' with it. Returns the
    communicators aborted."""
    _ABORTED.set()
    _ABORTED_ONCE.set()
    groupsockets.shut_down()
    aborted = 0
    for group in list(distributed_c10d._world.pg_map):
        try:
            backend = group._get_backend(torch.device("cuda"))
        except RuntimeError:  # no CUDA backend in this group
            continue
        if type(backend).__name__ != "ProcessGroupNCCL":
            continue
        try:
            backend.abort()
            aborted += 1
        except RuntimeError as exc:
            log.warning("could not abort a communicator: %s", exc)
    return aborted


def communicators_aborted() -> bool:
    """Whether the reform directive aborted this process's communicators (their work since then proves nothing)."""
    return _ABORTED.is_set()


def wait_until_aborted(timeout_s: float) -> bool:
    """Block until the communicators are aborted (fault injection: a device wait that never ends on its own)."""
    return _ABORTED.wait(timeout_s)


def ever_aborted() -> bool:
    """Whether this process ever aborted its communicators."""
    return _ABORTED_ONCE.is_set()


def joined_new_group() -> None:
    """A new group's communicators are whole again."""
    _ABORTED.clear()


def destroy_groups() -> None:
    """Destroy every process group of this process and free them now (the caller dropped its own references).

    The groups' connections are shut down first (:func:`groupsockets.shut_down`; a no-op where the reform directive
    did it already): a gloo group's destructor waits for its pending work, which on a connection to a peer that left
    without closing it ends only at the collective timeout, and that destructor runs inside ``gc.collect()`` under
    the GIL, where no deadline of ours can fire."""
    groupsockets.shut_down()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def for_backend(teardown: Teardown) -> Callable[[], None]:
    """The function that performs ``teardown``."""
    return abort_groups if teardown is Teardown.ABORT else destroy_groups


HANG_MARGIN_S = 30.0
"""What :func:`hang_guard`'s callers add to the sum of the deadlines inside the guarded section."""


@contextlib.contextmanager
def hang_guard(seconds: float, what: str) -> Iterator[None]:
    """End the process with every thread's stack on stderr if the ``with`` body runs longer than ``seconds``.

    Why: the body's own deadlines are Python threads, and a call that blocks while holding the GIL (a C++ wait that
    does not release it) stops them too, so a survivor could hang with nothing logged. ``faulthandler``'s timer is a
    C thread that needs no GIL: the stacks say where it hung. It can only exit 1, so the section is marked while it
    runs (:func:`disttrain.trainer.launch.leaving.marker`): the launcher reads a worker that exits 1 with the mark
    as a ``REFORM`` exit, never as the user's failure. Process-wide: one guard at a time (faulthandler keeps a
    single timer)."""
    log.debug("%s: guarded for %.0f s", what, seconds)
    marker = leaving.marker(os.getpid())
    marker.touch()
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        marker.unlink(missing_ok=True)


def run_with_deadline(teardown: Callable[[], None], deadline_s: float, what: str) -> None:
    """Run ``teardown`` in a thread and return once it returns (raising what it raised). If it is still running after
    ``deadline_s``, log why and end the process with ``ExitCode.REFORM``: the launcher restarts the worker."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            teardown()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            raised.append(exc)

    thread = threading.Thread(target=run, name="disttrain-leave-group", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        log.error(
            "leaving the process group (%s) did not finish within %.1f s (a dead communicator blocks it); "
            "exiting %d so the launcher restarts this worker",
            what,
            deadline_s,
            int(ExitCode.REFORM),
        )
        exits.hard_exit(ExitCode.REFORM)
    if raised:
        raise raised[0]
