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
from collections.abc import Callable
from typing import Optional

import torch
import torch.distributed as dist

from disttrain.trainer import teardown

FAULT_ABORTED_REDUCTION = "DISTTRAIN_FAULT_ABORTED_REDUCTION"
FAULT_HANG_DEVICE_WAIT = "DISTTRAIN_FAULT_HANG_DEVICE_WAIT"
"""``<step>[:<rank>]``: that rank's device wait of that step never ends on its own, as a kernel spinning on a dead
NCCL peer; only the reform directive's abort (:func:`disttrain.trainer.teardown.abort_communicators`) ends it."""


class StepAbortedError(dist.DistError):
    """A reduction of the step failed or was aborted on some rank: the step is not counted (the group re-forms)."""


def device_wait(wait: Callable[[], None], step: int, rank: int) -> None:
    """The device wait of ``step`` (``wait``), or under :data:`FAULT_HANG_DEVICE_WAIT` a wait that ends only when the
    communicators are aborted."""
    if injected_abort(step, rank, variable=FAULT_HANG_DEVICE_WAIT) and not teardown.ever_aborted():
        teardown.wait_until_aborted(HANG_LIMIT_S)
        return
    wait()


HANG_LIMIT_S = 600.0
"""How long an injected hang lasts at most when nothing aborts it."""


def injected_abort(
    step: int, rank: int, environ: Optional[dict[str, str]] = None, variable: str = FAULT_ABORTED_REDUCTION
) -> bool:
    """Whether fault injection (``variable``, by default an aborted reduction) names this rank's ``step``."""
    value = (environ if environ is not None else os.environ).get(variable, "")
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
    elif teardown.communicators_aborted():
        reason = "this rank's (communicators aborted by the reform directive)"
    elif what == "reductions" and injected_abort(step, rank):
        reason = "this rank's (fault injection)"
    elif what == "reductions":
        error = backend_error(None)
        if error is not None:
            reason = f"this rank's ({error})"
    if reason is not None:  # no need to ask the others: this rank's step is lost, and it leaves (they then fail too)
        raise StepAbortedError(f"step {step}: {reason} {what} failed or were aborted; the step is not counted")
    flag = torch.tensor([1], dtype=torch.int32)
    if dist.is_initialized():  # one process alone has nobody to agree with
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if int(flag.item()) == 0:
        raise StepAbortedError(f"step {step}: another rank's {what} failed or were aborted; the step is not counted")
