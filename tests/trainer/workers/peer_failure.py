"""One of two gloo processes for the collective-failure test. Usage: peer_failure.py died|hung COLLECTIVE.

Rank 1 SIGKILLs itself (``died``) or sleeps past the collective timeout (``hung``) once the group is up; rank 0
then runs COLLECTIVE (all_reduce, async_all_reduce, barrier, all_gather_object) and prints one JSON line: the
exception's type, the first line of its message and what ``is_collective_failure`` says about it.
"""

import datetime
import json
import os
import signal
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from disttrain.trainer.failures import is_collective_failure

COLLECTIVES: dict[str, Callable[[], object]] = {
    "all_reduce": lambda: dist.all_reduce(torch.ones(4)),
    "async_all_reduce": lambda: dist.all_reduce(
        torch.ones(6, dtype=torch.int64), op=dist.ReduceOp.MAX, async_op=True
    ).wait(),
    "barrier": lambda: dist.barrier(),
    "all_gather_object": lambda: dist.all_gather_object([None, None], {"digests": {}}),
}


def main() -> None:
    how, collective = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    dist.all_reduce(torch.ones(1))  # every connection is up
    if dist.get_rank() == 1:
        if how == "hung":
            time.sleep(60)
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "died":
        time.sleep(1.0)  # let the peer die first
    try:
        COLLECTIVES[collective]()
        result = {"raised": None}
    except Exception as exc:  # noqa: BLE001 - reporting it is the point
        result = {
            "raised": type(exc).__name__,
            "message": str(exc).splitlines()[0],
            "collective_failure": is_collective_failure(exc),
        }
    print(json.dumps(result), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
