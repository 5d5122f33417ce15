"""torch.distributed's debug mode (``spec.debug.distributed``) inside the trainer: what DETAIL needs from our code.

torch 2.13.0 segfaults when DDP is built on a gloo process group that ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wrapped in
its ``ProcessGroupWrapper``: ``c10d::Logger::set_env_variables`` takes the group's gloo backend, the wrapper, for a
``ProcessGroupGloo`` (seen with gdb on a one-line DDP; ``tests/e2e/test_desync.py`` runs DDP under DETAIL). On gloo
under DETAIL, :func:`ddp_process_group` gives DDP an unwrapped gloo group of the same ranks and timeout: its
gradient all-reduces go unchecked on the CPU, while every collective of the default group (the step boundary's, the
script's own) is still checked. NCCL groups are not affected and get nothing. Called by
:mod:`disttrain.trainer.parallel` on every rank (it creates a group: a collective).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from disttrain.trainer import groupsockets


def is_gloo_detail() -> bool:
    """Whether the default group is gloo wrapped by ``TORCH_DISTRIBUTED_DEBUG=DETAIL``."""
    return (
        dist.is_initialized()
        and dist.get_debug_level() == dist.DebugLevel.DETAIL
        and dist.get_backend() == dist.Backend.GLOO
    )


def ddp_process_group() -> Optional[dist.ProcessGroup]:
    """The group DDP must be built on instead of the default one; None: the default one."""
    if not is_gloo_detail():
        return None
    timeout = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout  # type: ignore[union-attr]
    previous = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.OFF)  # torch wraps a group when it is created, by the level then
    try:
        with groupsockets.capture():
            group: Optional[dist.ProcessGroup] = dist.new_group(backend=dist.Backend.GLOO, timeout=timeout)
        return group
    finally:
        dist.set_debug_level(previous)
