"""Telling a failed collective (a peer died or hung) from a bug, so the worker exits REFORM instead of 1.

torch types some of these failures: ``torch.distributed.DistError`` and its subclasses ``DistBackendError``
(NCCL), ``DistNetworkError`` and ``DistStoreError`` (the TCPStore). Gloo does not. On torch 2.13.0 with gloo on
CPU, checked by experiment and by ``tests/trainer/test_collective_failures.py``, a survivor whose peer was
SIGKILLed during ``all_reduce`` (sync and async), ``barrier`` or ``all_gather_object`` gets a plain
``RuntimeError``::

    [.../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:20866. ...

and one whose peer hangs past the collective timeout gets a plain ``RuntimeError`` too::

    [.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 4000ms for recv operation to complete

So for ``RuntimeError`` the message is still matched, here and nowhere else. The markers are the ones the
trainer has always used; the first two were seen on torch 2.13.0, the others cover older gloo builds, socket
errors and NCCL messages that were not reproduced on this CPU-only machine.
"""

from __future__ import annotations

import os
import resource

import torch.distributed as dist

CHECKED_ON = "torch 2.13.0, gloo on CPU"
"""Where :data:`RUNTIME_ERROR_MARKERS` was last checked against real failures."""

RUNTIME_ERROR_MARKERS: tuple[str, ...] = (
    "Connection closed by peer",  # gloo, peer died (seen on torch 2.13.0)
    "Timed out",
    "timed out",  # gloo, peer hung past the collective timeout (seen on torch 2.13.0)
    "Gloo",
    "gloo",  # any gloo transport error: its messages carry the gloo source path
    "Connection reset",
    "Socket",
    "socket",  # transport errors of older builds
    "NCCL",  # NCCL errors not (yet) raised as DistBackendError
)
"""Substrings of a ``RuntimeError`` message that mean a collective failed."""


FAULT_ABORT_ON_COLLECTIVE_FAILURE = "FAULT_INJECT_ABORT_ON_COLLECTIVE_FAILURE"
"""Fault injection, for tests only: with this variable set to ``1`` a process aborts (SIGABRT) as soon as a failed
collective is classified here, as NCCL's watchdog aborts every survivor of a dead peer
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, which torchrun sets). Gloo on CPU raises instead; the CPU test of the operator's
failure accounting (``tests/e2e/test_incident_accounting.py``) sets it to see survivors die that way."""


def is_collective_failure(exc: BaseException) -> bool:
    """True when ``exc`` says a collective or the group's store failed: a peer is gone or hung."""
    text = str(exc)
    failed = isinstance(exc, dist.DistError) or (
        isinstance(exc, RuntimeError) and any(marker in text for marker in RUNTIME_ERROR_MARKERS)
    )
    if failed:
        abort_if_injected()
    return failed


def abort_if_injected() -> None:
    """The fault hook of :data:`FAULT_ABORT_ON_COLLECTIVE_FAILURE`: abort without a core file when it is set."""
    if os.environ.get(FAULT_ABORT_ON_COLLECTIVE_FAILURE) == "1":
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.abort()
