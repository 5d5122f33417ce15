"""Which accelerator a worker uses: ``cuda:LOCAL_RANK`` among the devices this process sees, or a clear error.

torchrun numbers a node's workers ``LOCAL_RANK`` 0..nproc-1 and each takes the device of that index among those
``CUDA_VISIBLE_DEVICES`` leaves it. A node asked for more workers than it has GPUs would otherwise fail in
``torch.cuda.set_device`` with CUDA's "invalid device ordinal" and exit 1, which the launcher retries as a transient
failure, forever. A restart cannot add a GPU: :func:`missing_device_message` is the PERMANENT error instead.
Pure: no torch.
"""

from __future__ import annotations

from typing import Optional

VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"


def missing_device_message(local_rank: int, device_count: int, visible_devices: Optional[str]) -> Optional[str]:
    """Why worker ``local_rank`` has no GPU of its own among the ``device_count`` this process sees (None when it
    has one). ``visible_devices``: ``$CUDA_VISIBLE_DEVICES`` as set (None: unset, every GPU of the machine)."""
    if 0 <= local_rank < device_count:
        return None
    shown = "unset (every GPU of the machine)" if visible_devices is None else repr(visible_devices)
    return (
        f"LOCAL_RANK {local_rank} has no GPU of its own: this process sees {device_count} CUDA device(s) "
        f"(cuda:0..cuda:{max(device_count - 1, 0)}; ${VISIBLE_DEVICES_ENV} {shown}), and each worker of a node "
        f"uses the device of its LOCAL_RANK. Run at most {device_count} worker(s) per node (spec.nprocPerNode), "
        "or give the node more GPUs (the trainer container's nvidia.com/gpu request)"
        if device_count > 0
        else f"LOCAL_RANK {local_rank} has no GPU: this process sees no CUDA device (${VISIBLE_DEVICES_ENV} {shown})"
    )
