"""Ordering of Kubernetes resourceVersions, for caches that merge a watch with the responses of their own writes.

Both sides keep the newest object they have seen, and an answer to a write can arrive before or after the watch
event of an earlier write: keeping whichever came last would go back in time.
"""

from __future__ import annotations

from typing import Optional


def is_older(candidate: Optional[str], current: Optional[str]) -> bool:
    """``candidate`` is an older resourceVersion of the same object than ``current``.

    An object's resourceVersions come from one etcd revision counter (integers, and comparable as such since
    Kubernetes 1.34, KEP-5504). Anything else is never called older: an unusual server at worst shows a stale
    object until its next event.
    """
    if candidate is None or current is None or not candidate.isdigit() or not current.isdigit():
        return False
    return int(candidate) < int(current)
