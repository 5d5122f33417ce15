"""A worker whose group fails to start because its peers left exits REFORM, a bounded number of times in a row.

A node that joins a round can find the round gone before its group forms: a peer is lost while the group's store
barrier or gloo's connect (NCCL's communicator) waits for it, and ``init_process_group`` or the first agreement
fails with a collective failure (:func:`~disttrain.trainer.failures.is_collective_failure`). That is the job's
infrastructure, not the user's code: the worker exits ``REFORM`` and the launcher re-joins the rendezvous, where
an exit 1 would end the pod and spend the user's restart budget.

A group that can never start (a network that refuses the backend's connections, an NCCL that cannot initialise)
would turn that into an endless, invisible loop of re-joins. So the failed starts of this local rank are counted
in a file beside torchrun's error files (the directory is the launcher's, for its whole life), and after
:data:`MAX_FAILED_STARTS` in a row the failure goes to the user as any other (exit 1, charged). A start that forms
its group clears the count.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

from disttrain.api.exitcodes import ExitCode
from disttrain.trainer import exits, failures

log = logging.getLogger("disttrain.trainer")

MAX_FAILED_STARTS = 5
"""Failed group starts in a row that still re-join; the next one is the user's failure."""

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
"""torchrun's per-worker error file: ``<log dir>/<run>/attempt_<n>/<local rank>/error.json``."""


def counter_path(environ: Mapping[str, str]) -> Optional[Path]:
    """Where this local rank's count lives: the launcher's log directory, which outlives the worker's attempts.
    None without torchrun (a plain ``python train.py`` has nothing to re-join)."""
    error_file = environ.get(ERROR_FILE_ENV)
    if not error_file:
        return None
    path = Path(error_file)
    if len(path.parents) < 4:
        return None
    return path.parents[2] / f"failed-starts-{environ.get('LOCAL_RANK', '0')}"


def read_count(path: Path) -> int:
    try:
        return int(path.read_text(encoding="ascii").strip() or 0)
    except (OSError, ValueError):
        return 0


def should_rejoin(exc: BaseException, earlier_failures: int) -> bool:
    """True when ``exc`` is a failed collective (not a desync, not the user's error) and the starts that failed
    in a row before this one leave room for another re-join."""
    if earlier_failures >= MAX_FAILED_STARTS or failures.find_desync(exc) is not None:
        return False
    return failures.is_collective_failure(exc)


def exit_if_peers_failed(exc: BaseException, environ: Mapping[str, str] = os.environ) -> None:
    """End the worker ``REFORM`` when its start failed on its peers and the count allows; else return (the caller
    re-raises, and the failure is the user's)."""
    path = counter_path(environ)
    if path is None:
        return
    earlier = read_count(path)
    if not should_rejoin(exc, earlier):
        if earlier >= MAX_FAILED_STARTS:
            log.error("the group failed to start %d times in a row; this failure ends the pod", earlier + 1)
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(earlier + 1), encoding="ascii")
    except OSError as error:
        log.warning("cannot count the failed start (%s); re-joining anyway", error)
    log.warning(
        "the group failed to start (%s: %s); exiting %d to re-join the rendezvous (%d of %d in a row)",
        type(exc).__name__,
        str(exc).splitlines()[0] if str(exc) else "",
        int(ExitCode.REFORM),
        earlier + 1,
        MAX_FAILED_STARTS,
    )
    exits.hard_exit(ExitCode.REFORM)


def clear(environ: Mapping[str, str] = os.environ) -> None:
    """The group formed: the next failed start is the first of a new run."""
    path = counter_path(environ)
    if path is not None:
        path.unlink(missing_ok=True)
