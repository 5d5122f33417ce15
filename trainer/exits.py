"""How a worker ends when it must not run Python's normal shutdown.

After a drain checkpoint, a failed collective or an error a restart cannot fix, the worker leaves with
``os._exit``: torch's atexit hooks and destructors can block on a peer that is already gone.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

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
