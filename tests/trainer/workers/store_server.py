"""A plain TCPStore server in its own process: stands in for the job agent that hosts the c10d rendezvous store,
so no training node is a single point of failure. Usage: store_server.py PORT; prints "ready" once listening."""

import sys
import time
from datetime import timedelta

import torch.distributed as dist


def main() -> None:
    port = int(sys.argv[1])
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
    print("ready", flush=True)
    while True:
        time.sleep(3600)
    del store


if __name__ == "__main__":
    main()
