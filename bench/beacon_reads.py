"""What one read of every rank's step beacon costs the job agent's loop, at a job's number of ranks.

A libuv TCPStore server (the agent's store), one signed beacon per rank written through the signed store, and the
agent's stall watch (:class:`disttrain.trainer.agent.stalls.StallWatch`) reading them all as its loop does: one
``check`` and one ``multi_get`` through a signed client, every value verified. Beside it, in the same run, the same
read with the values the check verified dropped before the ``multi_get`` (each value read and verified twice: what
keeping them saves). Printed per rank count: the read's milliseconds both ways, their ratio, and how
often the agent reads at that size (:func:`disttrain.trainer.agent.stalls.read_interval_s`, ``stallMinSeconds``
60), hence the share of a core it spends on beacons.

    python bench/beacon_reads.py [--ranks 2048,8192] [--reads 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta
from typing import Any

import _localbench  # noqa: F401 - puts the repository on sys.path
import torch.distributed as dist

from disttrain.api import control, storeauth
from disttrain.trainer.agent import stalls
from disttrain.trainer.store import channel, signedstore

SECRET, UID = "b" * 64, "beacon-reads-bench"


class DropsKept(signedstore.SignedStore):
    """The signed store without the values a check kept: the multi_get reads and verifies every value again."""

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._take_checked()
        return super().multi_get(keys)


def timed_reads(store: Any, reads: int) -> float:
    watch = stalls.StallWatch(store)
    watch.read(0.0)
    times = []
    for i in range(reads):
        began = time.perf_counter()
        watch.read(float(i + 1))
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2048,8192", help="comma-separated rank counts")
    parser.add_argument("--reads", type=int, default=5, help="reads timed per count (the median is printed)")
    args = parser.parse_args()
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)

    def raw() -> Any:
        return dist.TCPStore(
            "127.0.0.1", server.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60)
        )

    writer = channel.scoped(raw(), SECRET, UID)
    for ranks in (int(n) for n in args.ranks.split(",")):
        for rank in range(ranks):
            beacon = control.StepBeacon(
                step=5, rank=rank, world_size=ranks, group="10.0.0.1:29500", node=f"node-{rank // 8}", time=time.time()
            )
            writer.set(control.beacon_key(rank), beacon.model_dump_json())
        once = timed_reads(channel.scoped(raw(), SECRET, UID), args.reads)
        twice = timed_reads(dist.PrefixStore(storeauth.key_prefix(SECRET), DropsKept(raw(), SECRET, UID)), args.reads)
        every = stalls.read_interval_s(ranks, min_seconds=60.0)
        print(
            f"ranks: {ranks}  read_ms: {once * 1000:.0f}  read_twice_verified_ms: {twice * 1000:.0f}  "
            f"ratio: {twice / once:.2f}  read_every_s: {every:g}  core_share: {once / every:.3f}"
        )


if __name__ == "__main__":
    main()
