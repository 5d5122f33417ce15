"""In-place reforms, the worker's side: keep the process, its model and optimizer, and their state in memory.

A reform used to end every worker: the survivors of a lost node built their model again, loaded the last checkpoint
and redid every step since. Here a survivor stays: when a collective fails (a peer is gone) or at a drain, it leaves
the broken process group, asks its launcher for the next round (:mod:`disttrain.trainer.launch.handover`), joins the new
group and goes on. The new group first agrees on the state (:func:`choose_source`): when a member holds a newer step
in memory than the newest checkpoint, that member's state is broadcast to the others (:func:`broadcast_state`), so
nothing since the checkpoint is redone; a replacement or hot spare that joins fresh receives it the same way.

Where it applies (:func:`applies`): ``spec.elastic.reformInPlace``. Under DDP every rank holds the whole state and the
new group takes it from one member (:func:`broadcast_state`); a sharded model (FSDP2, HSDP, FSDP x TP) is sharded
again on the new mesh and rebuilt from the members' memory (:mod:`disttrain.trainer.recovery`).
A failure is kept from the user's code where the trainer owns the call: ``step.backward`` (DDP's all-reduce),
``step.global_count``, the forward's buffer broadcast (:func:`guard_buffer_sync`), the optimizer step and the step
boundary. A collective that fails anywhere else ends the process as before (``ExitCode.REFORM``), and so does a
peer that vanished without closing its connections (power loss, partition): gloo's ``abort`` does not interrupt a
blocked receive (measured with torch 2.13), so the survivor only sees the failure after
``collectiveTimeoutSeconds``, and the watchdog restarts it sooner than that.
"""

from __future__ import annotations

import dataclasses
import io
import logging
from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.nn.parallel import DistributedDataParallel

from disttrain.trainer import groupsockets, teardown
from disttrain.trainer.failures import is_collective_failure
from disttrain.trainer.replicas import wire

log = logging.getLogger("disttrain.trainer")

NO_STATE = -1
"""The memory step of a process that holds no training state yet (it has not resumed)."""


def is_group_failure(exc: BaseException) -> bool:
    """A collective failed (a peer is gone or hung), also when DCP wrapped it in its ``CheckpointException``."""
    if is_collective_failure(exc):
        return True
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and isinstance(failures, dict):
        return any(isinstance(f, BaseException) and is_collective_failure(f) for f in failures.values())
    return False


def applies(reform_in_place: bool) -> bool:
    """Whether a job's workers reform in place: the same answer on every rank (it decides collectives)."""
    return reform_in_place


def fallback_reason(requested: bool, parallelism: str, prewrapped: bool, has_launcher: bool) -> Optional[str]:
    """Why this worker restarts on a reform although ``spec.elastic.reformInPlace`` asks to stay; None: it stays (or
    in place was not asked for). ``parallelism``: the trainer's option value; ``prewrapped``: the script passed a model
    already wrapped in DDP; ``has_launcher``: the process has a channel to its launcher."""
    if not applies(requested):
        return None
    if prewrapped:
        return "the model passed is already a DistributedDataParallel: pass the unwrapped model, the trainer wraps it"
    if not has_launcher:
        return "the worker has no channel to the disttrain launcher (it was not started by it, or its socket failed)"
    return None


def log_fallback(reason: Optional[str]) -> None:
    """Say once, at start, why a reform restarts this worker from the last checkpoint instead of keeping it."""
    if reason is not None:
        log.warning(
            "spec.elastic.reformInPlace is set, but reforms restart the workers from the last checkpoint: %s", reason
        )


@dataclasses.dataclass(frozen=True)
class Holding:
    """What one rank of a new group holds when the group agrees on the state."""

    memory_step: int
    """The step of the state in this process's memory; :data:`NO_STATE` for a fresh process."""
    disk_step: int
    """The newest complete checkpoint this rank finds; :data:`NO_STATE` for none."""


def gather_holdings(memory_step: int, disk_step: int, world_size: int) -> list[Holding]:
    """Every rank's :class:`Holding`, in rank order. Collective."""
    mine = torch.tensor([memory_step, disk_step], dtype=torch.int64)
    gathered = [torch.zeros(2, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    return [Holding(int(t[0]), int(t[1])) for t in gathered]


def choose_source(holdings: list[Holding]) -> Optional[int]:
    """The rank whose memory the group takes its state from: the lowest rank holding the newest step in memory, when
    that step is at least the newest checkpoint rank 0 finds (so nothing committed is ever rolled back); None: load
    the checkpoint (or start afresh). Pure: every rank computes it from the same gathered list."""
    if not holdings:
        return None
    newest = max(h.memory_step for h in holdings)
    if newest == NO_STATE or newest < holdings[0].disk_step:
        return None
    return next(rank for rank, h in enumerate(holdings) if h.memory_step == newest)


def broadcast_state(contents: Mapping[str, Any], source: int, receive: bool) -> int:
    """Broadcast the state of ``contents`` (name -> Stateful, as a checkpoint holds them) from rank ``source``; the
    ranks with ``receive`` load it. Collective on the default group (CPU tensors: gloo). Returns the bytes sent."""
    rank = dist.get_rank()
    if rank == source:
        buffer = io.BytesIO()
        torch.save({name: stateful.state_dict() for name, stateful in contents.items()}, buffer)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, source)
    if rank != source:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, source)
    if receive and rank != source:
        # Onto the CPU: RNG states must stay there, and loading copies every tensor onto its parameter's device.
        state = wire.safe_load(payload.numpy().tobytes())
        for name, stateful in contents.items():
            stateful.load_state_dict(state[name])
    return int(size.item())


def broadcast_module(module: torch.nn.Module, source: int = 0) -> None:
    """Rank ``source``'s parameters and buffers everywhere: what DDP's construction does, which in-place groups skip
    (``init_sync=False``: a survivor's weights must not be overwritten by a fresh rank 0's). Collective."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, source)


def guard_buffer_sync(ddp: DistributedDataParallel, on_failure: Callable[[BaseException], None]) -> None:
    """Keep a failed buffer broadcast at the start of DDP's forward from the user's code: the failure is reported to
    ``on_failure`` and the forward runs on this rank's own buffers (the step is discarded and redone)."""
    sync: Callable[[], None] = ddp._sync_buffers  # torch leaves it unannotated

    def guarded() -> None:
        try:
            sync()
        except BaseException as exc:
            if not is_collective_failure(exc):
                raise
            on_failure(exc)

    ddp._sync_buffers = guarded  # type: ignore[method-assign]


def retire(ddp: Any) -> None:
    """Make a DDP wrapper of a left group inert: its gradient hooks removed (the next wrapper's are the only ones) and
    a call to it an error, so a reference kept in the training script cannot train unsynchronised."""
    remove = getattr(ddp, "_remove_autograd_hooks", None)
    if callable(remove):
        try:
            remove()
        except Exception as exc:  # noqa: BLE001 - a broken reducer may refuse; the wrapper is dropped anyway
            log.debug("could not remove the old DDP hooks: %s", exc)

    def stale(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "this model wrapper belongs to a process group that was re-formed in place: call trainer.model "
            "again at each step instead of keeping a reference to it"
        )

    ddp.forward = stale


def leave_groups(deadline_s: float = teardown.LEAVE_DEADLINE_S) -> None:
    """Leave every process group of this process and free them now (the caller dropped its own references): abort a
    group with an NCCL backend, destroy a gloo one (:mod:`disttrain.trainer.teardown`), within ``deadline_s`` or the
    process exits ``REFORM``.

    Why free at once: a gloo group closes its connections only when the object is freed, and a peer's pending operation
    on it fails only then (measured: at once, 0.1 s). Left to the garbage collector, the old group lives on in a
    reference cycle; a survivor then frees its group in the middle of the next group's first broadcast, and that
    destructor waits for an operation a peer only fails once its own old group is freed: both stall."""
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    how = teardown.choose(backend)
    teardown.run_with_deadline(teardown.for_backend(how), deadline_s, f"{how.value}, backend {backend}")
    groupsockets.forget()
