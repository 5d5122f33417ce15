"""``python -m disttrain.trainer.launch``: the worker pod's launcher (:mod:`disttrain.trainer.launch.launcher`).

Before the launcher proper, this process imports torch and forks the first workers' warm interpreter from itself
(:func:`disttrain.trainer.launch.prestart.become_warm_interpreter`); the fork runs the interpreter here, at the top
level, and ends as ``python -m disttrain.trainer.launch.warmproc`` would."""

import os
import sys

from disttrain.trainer.launch import debugenv, prestart, warmproc

debugenv.apply(os.environ)  # spec.debug: torch reads TORCH_DISTRIBUTED_DEBUG at import, in the warm interpreter too

if prestart.become_warm_interpreter(sys.argv[1:]):
    warmproc.main()
else:
    from disttrain.trainer.launch.launcher import main

    main()
