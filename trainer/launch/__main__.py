"""``python -m disttrain.trainer.launch``: the worker pod's launcher (:mod:`disttrain.trainer.launch.launcher`).

The handover socket opens and the warm interpreters start before this process imports torch: they import it
meanwhile."""

import sys

from disttrain.trainer.launch import prestart

prestart.open_handover()  # first: the prestarted interpreters get the workers' whole environment
prestart.WARM_POOL.prestart(sys.argv[1:])

from disttrain.trainer.launch.launcher import main  # noqa: E402 (torch, after the prestart on purpose)

main()
