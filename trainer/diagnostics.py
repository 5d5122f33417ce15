"""What a rank writes when the job agent finds a stalled step: its Python stacks and the flight recorder's trace.

Called by the watchdog thread (:mod:`disttrain.trainer.control`) on a ``DiagnosticsRequest``, so it runs while the
main thread is stuck in a collective or elsewhere: ``faulthandler`` reads every thread's stack without the main
thread's help. Files go to ``<directory>/<node>/<id>-rank<r>.stacks.txt`` and, where torch keeps a flight recorder
(NCCL's ``_dump_nccl_trace``, else the generic ``_dump_fr_trace``), ``<id>-rank<r>.trace.pkl`` (torch's pickle,
read by ``python -m torch.distributed.flight_recorder``). Best effort: a failure is logged, never raised.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import re
from typing import Optional

log = logging.getLogger("disttrain.trainer")

SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


def dump(directory: str, request_id: str, node: str, rank: int) -> list[str]:
    """Write this rank's stacks (and flight-recorder trace, where there is one); the paths written."""
    folder = os.path.join(directory, _safe(node) or "node")
    base = os.path.join(folder, f"{_safe(request_id)}-rank{rank}")
    written: list[str] = []
    try:
        os.makedirs(folder, exist_ok=True)
        with open(base + ".stacks.txt", "w") as handle:
            faulthandler.dump_traceback(handle, all_threads=True)
        written.append(base + ".stacks.txt")
        trace = flight_recorder_trace()
        if trace is not None:
            with open(base + ".trace.pkl", "wb") as handle:
                handle.write(trace)
            written.append(base + ".trace.pkl")
    except OSError as error:
        log.warning("could not write the stall diagnostics under %s: %s", folder, error)
    if written:
        log.warning("stalled step: wrote %s", ", ".join(written))
    return written


def flight_recorder_trace() -> Optional[bytes]:
    """torch's flight-recorder trace of this process (NCCL's where the build has it); None where it has none."""
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return None
    for name in ("_dump_nccl_trace", "_dump_fr_trace"):
        dump_trace = getattr(c10d, name, None)
        if dump_trace is None:
            continue
        try:
            trace = dump_trace()
        except Exception as error:  # noqa: BLE001 - no recorder in this build or group: the stacks still say much
            log.debug("%s failed: %r", name, error)
            continue
        return trace if isinstance(trace, bytes) else None
    return None


def _safe(name: str) -> str:
    return SAFE_NAME.sub("_", name)[:200]
