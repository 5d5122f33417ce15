"""``python -m disttrain.trainer.agent``: the job agent (:mod:`disttrain.trainer.agent.service`)."""

from disttrain.trainer.agent.service import main

raise SystemExit(main())
