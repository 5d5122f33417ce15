"""How a worker ends when it must not run Python's normal shutdown.

After a drain checkpoint, a failed collective or an error a restart cannot fix, the worker leaves with
``os._exit``: torch's atexit hooks and destructors can block on a peer that is already gone.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

from torch.distributed.elastic.multiprocessing.errors import get_error_handler

from disttrain.api.exitcodes import ExitCode
from disttrain.trainer.control import report_failure

log = logging.getLogger("disttrain.trainer")


def hard_exit(code: ExitCode) -> NoReturn:
    """Flush the logs and leave at once with ``code``."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


def exit_permanent(message: str) -> NoReturn:
    """Log ``message``, tell the job agent (torchrun hides our exit code from the pod), exit PERMANENT."""
    log.error("%s (exit %d: a restart cannot fix this)", message, int(ExitCode.PERMANENT))
    report_failure(int(ExitCode.PERMANENT), message)
    hard_exit(ExitCode.PERMANENT)


def record_error(exc: BaseException) -> None:
    """Write ``exc`` to torchrun's error file (``TORCHELASTIC_ERROR_FILE``), as ``@record`` does for a ``main``.

    torchrun reads it into the failure it reports (``ProcessFailure.message``: ``"ValueError: ..."``, the last
    line of the traceback), and the launcher puts that line in the pod's termination message. Without torchrun
    (no error file set) nothing is written; a failure to write is only logged.
    """
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    try:
        get_error_handler().record_exception(exc)
    except OSError as error:
        log.warning("could not write torchrun's error file: %s", error)
