"""Tiny torchrun worker for the rendezvous tests: records which round it was started in, then exits.
No torch import, so the measured time is the rendezvous, not the worker's start-up."""

import json
import os
import time

record = {key: os.environ.get(key) for key in ("DISTTRAIN_NODE_NAME", "RANK", "WORLD_SIZE", "GROUP_RANK")}
record["time"] = time.time()
with open(os.path.join(os.environ["PROBE_OUT"], f"{os.environ['DISTTRAIN_NODE_NAME']}.json"), "w") as f:
    json.dump(record, f)
time.sleep(float(os.environ.get("PROBE_SLEEP", "2")))
