"""``python -m disttrain.trainer.launch``: the worker pod's launcher (:mod:`disttrain.trainer.launch.launcher`).

The handover socket opens and the warm interpreters start before this process imports torch: they import it
meanwhile."""

import os
import sys

from disttrain.trainer.launch import debugenv, prestart

debugenv.apply(os.environ)  # spec.debug: torch reads TORCH_DISTRIBUTED_DEBUG at import, in the warm interpreters too
prestart.open_handover()  # first: the prestarted interpreters get the workers' whole environment
prestart.WARM_POOL.prestart(sys.argv[1:])

from disttrain.trainer.launch.launcher import main  # noqa: E402 (torch, after the prestart on purpose)

main()
