"""The job agent's memory under a flood of large values from a stranger.

A child process plays the agent's store side: the libuv TCPStore server as
:func:`disttrain.trainer.agent.service.start_store`
starts it, a few sealed values of the job (the rendezvous state, the directive), and the store guardian
(:mod:`disttrain.trainer.agent.guardian`) sweeping it. Attacker processes with no secret connect as plain ``TCPStore``
clients and ``set`` values of ``--value-mib`` MiB under fresh keys as fast as the loopback allows, half inside
the job's (public) key namespace, half outside, for ``--seconds``. Printed: the agent process's resident memory
before the flood and at its peak (``VmHWM``), the MiB the attackers sent, and what the guardian deleted, plus
whether the job's sealed values were still valid at the end.

    python bench/store_flood.py                      # 60 s, 8 MiB values, 2 attackers
    python bench/store_flood.py --no-guardian --seconds 5   # the unprotected baseline (grows without bound)
    python bench/store_flood.py --no-pin             # guardian, glibc's default mmap threshold
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import pathlib
import sys
import time
import uuid
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from disttrain.api import storeauth  # noqa: E402

SECRET = "flood-bench-" + "0" * 52
JOB_UID = str(uuid.UUID(int=27))
OWN_KEYS = ("torch.rendezvous.bench", "disttrain/signal", "disttrain/target")


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def agent_side(port_queue: Any, stop: Any, guard: bool, pin: bool, report: Any) -> None:
    """The agent's store + guardian, in its own process so that its memory is measured alone."""
    from disttrain.trainer.agent import guardian
    from disttrain.trainer.agent import service as agent

    if pin:
        guardian.pin_mmap_threshold()
    server = agent.start_store(0, "127.0.0.1")
    namespace = storeauth.key_prefix(SECRET) + "/"
    for seq, name in enumerate(OWN_KEYS, start=1):
        key = namespace + name
        server.set(key, storeauth.seal(SECRET, JOB_UID, key, b"value of " + name.encode(), seq))
    sweeper = guardian.Guardian(server, SECRET, JOB_UID)
    if guard:
        sweeper.start()
    port_queue.put(server.port)
    stop.wait()
    sweeper.stop()
    intact = sum(
        storeauth.unseal(SECRET, JOB_UID, namespace + name, server.get(namespace + name)) is not None
        for name in OWN_KEYS
    )
    left = server.list_keys()
    report.put(
        {
            "deleted": sum(n for (_c, r), n in sweeper.counts().items() if r in ("foreign", "unsigned")),
            "keys_left": len(left),
            "own_keys_intact": intact,
        }
    )


def attacker(port: int, seconds: float, value_mib: int, index: int, sent: Any, took: Any) -> None:
    """A stranger: no secret, a plain client, fresh keys, as fast as it can."""
    from torch.distributed import TCPStore

    client = TCPStore(
        "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
    )
    namespace = storeauth.key_prefix(SECRET) + "/"
    value = os.urandom(value_mib << 20)
    began = time.monotonic()
    deadline = began + seconds
    count = 0
    try:
        while time.monotonic() < deadline:
            inside = count % 2 == 0
            key = (namespace + "torch.rendezvous.x" if inside else "junk/") + f"{index}-{count}"
            client.set(key, value)
            count += 1
    except Exception as error:  # noqa: BLE001 - the server may drop a client; report what was sent
        print(f"attacker {index} stopped: {error!r}", flush=True)
    client.num_keys()  # answered once the server has taken in every value sent before it
    with sent.get_lock():
        sent.value += count * value_mib
        took.value = max(took.value, time.monotonic() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--value-mib", type=int, default=8)
    parser.add_argument("--attackers", type=int, default=2)
    parser.add_argument("--no-guardian", dest="guardian", action="store_false")
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="leave glibc's mmap threshold dynamic")
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")
    port_queue, report, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    sent, took = ctx.Value("q", 0), ctx.Value("d", 0.0)
    side = ctx.Process(target=agent_side, args=(port_queue, stop, args.guardian, args.pin, report))
    side.start()
    port = port_queue.get(timeout=60)
    time.sleep(1.0)
    baseline = rss_kib(side.pid or 0)
    attackers = [
        ctx.Process(target=attacker, args=(port, args.seconds, args.value_mib, i, sent, took))
        for i in range(args.attackers)
    ]
    for proc in attackers:
        proc.start()
    samples = []
    while any(p.is_alive() for p in attackers):
        samples.append(rss_kib(side.pid or 0))
        time.sleep(0.05)
    for proc in attackers:
        proc.join()
    flood_s = took.value
    peak = rss_kib(side.pid or 0, "VmHWM")
    time.sleep(2.0)
    after = rss_kib(side.pid or 0)
    stop.set()
    result = report.get(timeout=60)
    side.join(timeout=30)
    print(f"guardian: {args.guardian}, pinned mmap threshold: {args.pin}, {args.attackers} attackers")
    print(f"flood_seconds: {flood_s:.1f}")
    print(f"flood_mb_sent: {sent.value * 1.048576:.0f}")
    print(f"flood_mb_per_s: {sent.value * 1.048576 / flood_s:.0f}")
    print(f"baseline_rss_mb: {baseline / 1024:.0f}")
    print(f"peak_rss_mb: {peak / 1024:.0f}")
    print(f"p99_sampled_rss_mb: {sorted(samples)[int(0.99 * (len(samples) - 1))] / 1024:.0f}" if samples else "")
    print(f"rss_after_flood_mb: {after / 1024:.0f}")
    print(f"ratio: {peak / max(baseline, 1):.2f}")
    print(f"values_deleted: {result['deleted']}")
    print(f"keys_left: {result['keys_left']}")
    print(f"own_keys_intact: {result['own_keys_intact']}/{len(OWN_KEYS)}")


if __name__ == "__main__":
    main()
