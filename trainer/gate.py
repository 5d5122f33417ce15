"""Whether a step may count: every rank's reductions of the step succeeded, decided before ``optimizer.step``.

On an accelerator a reduction that NCCL's watchdog (or the reform directive) aborted returns early, and the step's
event completes normally: the host cannot tell from the wait alone. So after the device wait each rank reads its
communicators' error state (``ProcessGroup.get_error``), and the ranks agree, with one tiny all-reduce over the CPU
(gloo) side of the group, that every one of them saw its reductions complete and its in-memory copy done. A rank
whose reductions failed, or that hears another rank's did, leaves its parameters and optimizer state at the previous
step: nothing that may hold a partial gradient is ever stepped, counted, captured or offered to a new group.

On gloo a failed reduction raises, and the exception decides as before; the agreement then also covers a rank that
broke while its peers' reductions completed. Fault injection (tests only): ``DISTTRAIN_FAULT_ABORTED_REDUCTION``
=``<step>[:<rank>]`` makes that rank's error state read "aborted" at that step, as NCCL's does after an abort.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

FAULT_ABORTED_REDUCTION = "DISTTRAIN_FAULT_ABORTED_REDUCTION"


class StepAbortedError(dist.DistError):
    """A reduction of the step failed or was aborted on some rank: the step is not counted (the group re-forms)."""


def injected_abort(step: int, rank: int, environ: Optional[dict[str, str]] = None) -> bool:
    """Whether fault injection says this rank's reductions of ``step`` were aborted."""
    value = (environ if environ is not None else os.environ).get(FAULT_ABORTED_REDUCTION, "")
    if not value:
        return False
    at, _, who = value.partition(":")
    return at.strip().isdigit() and int(at) == step and (not who.strip() or int(who) == rank)


def backend_error(group: Optional[dist.ProcessGroup]) -> Optional[str]:
    """The error state of the group's communicators (None: no error). Gloo reports none; its failures raise."""
    pg = group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)
    if pg is None:
        return None
    get_error = getattr(pg, "get_error", None)
    if get_error is None:
        return None
    try:
        state = get_error()
    except RuntimeError:  # a backend that does not report its state
        return None
    name = getattr(state, "name", str(state))
    return None if name == "SUCCESS" else name


def agree(local_ok: bool, step: int, rank: int, what: str = "reductions") -> None:
    """Raise :class:`StepAbortedError` unless every rank's ``what`` of ``step`` succeeded. Collective (one int on
    the CPU: gloo, which a dead NCCL communicator does not block). For the reductions, this rank's own verdict also
    reads the communicators' error state."""
    reason = None
    if not local_ok:
        reason = "this rank's"
    elif what == "reductions" and injected_abort(step, rank):
        reason = "this rank's (fault injection)"
    elif what == "reductions":
        error = backend_error(None)
        if error is not None:
            reason = f"this rank's ({error})"
    flag = torch.tensor([0 if reason else 1], dtype=torch.int32)
    if dist.is_initialized():  # one process alone has nobody to agree with
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if reason is not None:
        raise StepAbortedError(f"step {step}: {reason} {what} failed or were aborted; the step is not counted")
    if int(flag.item()) == 0:
        raise StepAbortedError(f"step {step}: another rank's {what} failed or were aborted; the step is not counted")
