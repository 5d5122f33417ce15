"""The elastic context: who this process is in the current rendezvous round and what the job asked for.

Reads torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, TORCHELASTIC_RESTART_COUNT,
TORCHELASTIC_RUN_ID, ...) and the ``DISTTRAIN_*`` contract variables, and initialises the process group with the
contract's short collective timeout, so a dead peer fails a collective instead of hanging it for torch's
default 30 minutes. RANK changes between rounds: nothing persistent may be keyed by it (checkpoint state uses
global keys; the node name, not the rank, identifies a machine).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from disttrain.api import env as env_names
from disttrain.api.contract import WorkerContract, job_checkpoint_dir
from disttrain.common.ports import free_port
from disttrain.trainer import exits, flightrecorder, groupsockets, localdevice, peerobjects

log = logging.getLogger("disttrain.trainer")


class ContractError(ValueError):
    """The worker contract is missing or invalid: a configuration error a restart cannot fix."""


@dataclasses.dataclass(frozen=True)
class ElasticContext:
    rank: int
    local_rank: int
    world_size: int
    group_rank: int
    restart_count: int
    run_id: str
    contract: WorkerContract
    checkpoint_dir: Path
    node_name: str
    agent_endpoint: Optional[str]
    metrics_port: int
    job: Optional[str]
    job_uid: str = ""
    """metadata.uid of the job (``$DISTTRAIN_JOB_UID``, "" when unknown): recorded in the fence and in every
    manifest; directive generations count within one uid."""

    @classmethod
    def from_env(cls, environ: Optional[dict[str, str]] = None) -> ElasticContext:
        e = dict(os.environ if environ is None else environ)
        raw = e.get(env_names.CONTRACT)
        if not raw:
            raise ContractError(
                f"${env_names.CONTRACT} is not set: run under the disttrain operator, "
                "`disttrain local`, or set it to a WorkerContract JSON document"
            )
        try:
            contract = WorkerContract.from_env_value(raw)
        except ValueError as exc:
            raise ContractError(f"${env_names.CONTRACT} is not a valid WorkerContract: {exc}") from exc
        name, namespace = e.get(env_names.JOB_NAME), e.get(env_names.JOB_NAMESPACE, "default")
        ckpt = e.get(env_names.CHECKPOINT_DIR)
        if not ckpt:
            ckpt = job_checkpoint_dir(contract.checkpoint.path, namespace, name or "job")
        return cls(
            rank=int(e.get("RANK", "0")),
            local_rank=int(e.get("LOCAL_RANK", "0")),
            world_size=int(e.get("WORLD_SIZE", "1")),
            group_rank=int(e.get("GROUP_RANK", "0")),
            restart_count=int(e.get("TORCHELASTIC_RESTART_COUNT", "0")),
            run_id=e.get("TORCHELASTIC_RUN_ID", ""),
            contract=contract,
            checkpoint_dir=Path(ckpt),
            node_name=e.get(env_names.NODE_NAME, os.uname().nodename),
            agent_endpoint=e.get(env_names.AGENT_ENDPOINT) or None,
            metrics_port=int(e.get(env_names.METRICS_PORT, "0") or 0),
            job=f"{namespace}/{name}" if name else None,
            job_uid=e.get(env_names.JOB_UID, ""),
        )


@dataclasses.dataclass
class Groups:
    """The default group (gloo on CPU, nccl on GPU) and a gloo group for checkpoint I/O.

    The checkpoint group is separate even on CPU: an async save runs its own collectives in a background
    thread, and two threads must not interleave collectives on one group.
    """

    default: Optional[dist.ProcessGroup]
    checkpoint: Optional[dist.ProcessGroup]
    device: torch.device


def init_process_group(ctx: ElasticContext, use_cuda: Optional[bool] = None) -> Groups:
    """Join the group on ``cuda:LOCAL_RANK`` (nccl) when ``use_cuda`` (default: when CUDA is available), else on
    the CPU (gloo).

    On CUDA a ``LOCAL_RANK`` without a device of its own ends the worker PERMANENT
    (:func:`~disttrain.trainer.localdevice.missing_device_message`), and the group is bound to the device
    (``device_id``): NCCL's communicator is created here rather than at the first collective, so a peer that cannot
    join fails the group's start, and torch can abort this device's communicator on its own."""
    peerobjects.install()  # before any object collective: peers' pickles are decoded as plain data only
    timeout = datetime.timedelta(seconds=ctx.contract.collective_timeout_seconds)
    device_id: Optional[torch.device] = None
    if use_cuda if use_cuda is not None else torch.cuda.is_available():
        problem = localdevice.missing_device_message(
            ctx.local_rank, torch.cuda.device_count(), os.environ.get(localdevice.VISIBLE_DEVICES_ENV)
        )
        if problem is not None:
            exits.exit_permanent(problem)
        torch.cuda.set_device(ctx.local_rank)
        device = device_id = torch.device("cuda", ctx.local_rank)
        backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    with groupsockets.capture():
        checkpoint = _join(ctx, backend, timeout, device_id)
    if device_id is not None:
        uid = nccl_uid(device_id)
        store = dist.distributed_c10d._get_default_store()
        flightrecorder.watch_reformed_group(os.environ, dist.get_rank(), uid, store)
    return Groups(default=dist.group.WORLD, checkpoint=checkpoint, device=device)


def _join(
    ctx: ElasticContext, backend: str, timeout: datetime.timedelta, device_id: Optional[torch.device]
) -> Optional[dist.ProcessGroup]:
    """The default group (unless one exists) and the checkpoint group."""
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            # A plain `python train.py` run: a one-process group on a free local port.
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group(
            backend=backend, timeout=timeout, rank=ctx.rank, world_size=ctx.world_size, device_id=device_id
        )
    group: Optional[dist.ProcessGroup] = dist.new_group(backend="gloo", timeout=timeout)
    return group


def nccl_uid(device: torch.device) -> Optional[int]:
    """The process-wide number of the default group's NCCL backend on ``device`` (None when it has none): torch's
    own flight-recorder dumps only happen for uid 0 (:mod:`disttrain.trainer.flightrecorder`)."""
    group = dist.group.WORLD
    if group is None:
        return None
    try:
        backend = group._get_backend(device)
    except RuntimeError:
        return None
    while hasattr(backend, "wrapped_pg"):  # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps it
        backend = backend.wrapped_pg
    uid = getattr(backend, "uid", None)
    return uid if isinstance(uid, int) else None
