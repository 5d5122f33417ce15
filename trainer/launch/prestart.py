"""What the launcher sets up before torchrun starts: the handover socket and the first workers' warm interpreter."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Optional

from disttrain.api import env
from disttrain.trainer.launch import warmproc, warmstart
from disttrain.trainer.launch.handover import Broker
from disttrain.trainer.launch.warmstart import WarmPool

WARM_POOL = WarmPool()
"""This agent's warm worker interpreters."""
HANDOVER: Optional[Broker] = None
"""Where this agent's workers wait for the next round in place (:mod:`disttrain.trainer.launch.handover`)."""


def open_handover(*, accept: bool = True) -> Optional[Broker]:
    """The handover socket, named in the workers' environment (``$DISTTRAIN_LAUNCHER_SOCKET``) before any starts;
    ``accept=False``: bound but not served yet (no thread runs, see :func:`become_warm_interpreter`)."""
    global HANDOVER
    if HANDOVER is None:
        HANDOVER = Broker.bind()
        if HANDOVER is not None:
            os.environ[env.LAUNCHER_SOCKET] = HANDOVER.name
    if HANDOVER is not None and accept:
        HANDOVER.start()
    return HANDOVER


def become_warm_interpreter(launcher_argv: Sequence[str]) -> bool:
    """Prestart the first workers' warm interpreter; True in that interpreter, a fork of this process.

    Call at the top of the launcher's ``__main__``, before anything starts a thread. This process imports torch
    first, with the environment its workers will have (torch reads some of it at import), and the interpreter is
    forked from it (:meth:`WarmPool.prestart_here`): the node imports torch once, not once in the launcher and again
    in the interpreter. In the child, the caller runs :func:`disttrain.trainer.launch.warmproc.main` at its top level
    and lets the interpreter end as it would after ``python script.py``."""
    os.environ.update(warmstart.worker_env_defaults(launcher_argv))
    warmproc.import_torch()
    open_handover(accept=False)
    try:
        WARM_POOL.prestart_here(launcher_argv)
    except warmstart.InWarmInterpreter:
        global HANDOVER
        if HANDOVER is not None:
            HANDOVER.forget_in_fork()
            HANDOVER = None
        return True
    open_handover()
    return False
