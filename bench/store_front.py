"""What the store front costs: store round trips through the front against direct, and a local reform with and
without it.

Round trips: a child process serves the agent's store (:func:`disttrain.trainer.agent.service.start_store`) and
its front (:mod:`disttrain.trainer.store.front`), as the agent does; a client does ``--ops`` ``get``s and ``set``s
of a 3 KiB value, raw (torch's client) and signed (the job's view, :func:`disttrain.trainer.store.channel.scoped`),
once straight to the store and once through its own relay and the front. Printed: p50 and p99 of each (ms) and
the ratios.

Reform: ``bench/reform.py``'s P1 (3 nodes, one machine killed while the size drops to 2; from the kill to the first
step at the new size), ``--runs`` times with the front and as many without it (the operator's
``$DISTTRAIN_STORE_FRONT`` set to ``0``: the agent serves its store bare and clients connect straight), alternated
so that the machine's load falls on both alike. Printed: the medians and their ratio (goal: <= 1.10).

    python bench/store_front.py [--ops 2000] [--runs 3] [--only trips|reform]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import _localbench  # noqa: F401 - puts the repository on sys.path
import reform
from torch.distributed import TCPStore

from disttrain.operator import access
from disttrain.trainer.agent import service
from disttrain.trainer.store import channel, relay

SECRET = "front-bench-" + "0" * 52
VALUE = b"v" * 3072


def _percentiles(times: list[float]) -> tuple[float, float]:
    ordered = sorted(times)
    return ordered[len(ordered) // 2] * 1e3, ordered[int(len(ordered) * 0.99)] * 1e3


def _timed(op: Callable[[], Any], ops: int) -> tuple[float, float]:
    times = []
    for _ in range(ops):
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return _percentiles(times)


def agent_side(ports: Any, stop: Any) -> None:
    """The agent's store and its front, in a process of their own as in the agent."""
    os.environ["DISTTRAIN_STORE_SECRET"] = SECRET
    server = service.start_store()
    gate = service.start_front("127.0.0.1", 0, server)
    ports.put((int(server.port), gate.address[1]))
    stop.wait()
    gate.stop()


def trips(ops: int) -> dict[str, float]:
    ports, stop = multiprocessing.Queue(), multiprocessing.Event()
    agent = multiprocessing.Process(target=agent_side, args=(ports, stop), daemon=True)
    agent.start()
    store_port, front_port = ports.get(timeout=60)
    near = relay.Relay(("127.0.0.1", front_port), SECRET)
    figures: dict[str, float] = {}
    for path, address in (("direct", ("127.0.0.1", store_port)), ("front", near.address)):
        raw = TCPStore(*address, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))
        signed = channel.scoped(raw, SECRET, "bench-uid")
        for view, store in (("raw", raw), ("signed", signed)):
            store.set("bench", VALUE)
            for op, call in (("get", lambda s=store: s.get("bench")), ("set", lambda s=store: s.set("bench", VALUE))):
                p50, p99 = _timed(call, ops)
                figures[f"{view}_{op}_{path}_p50_ms"], figures[f"{view}_{op}_{path}_p99_ms"] = p50, p99
    for view in ("raw", "signed"):
        for op in ("get", "set"):
            for q in ("p50", "p99"):
                figures[f"{view}_{op}_{q}_ratio"] = (
                    figures[f"{view}_{op}_front_{q}_ms"] / figures[f"{view}_{op}_direct_{q}_ms"]
                )
    near.close()
    stop.set()
    agent.join(timeout=10)
    return figures


def reforms(runs: int, steps: int) -> dict[str, float]:
    times: dict[str, list[float]] = {"front": [], "bare": []}
    for _ in range(runs):
        for mode in ("front", "bare"):
            access.STORE_FRONT = "1" if mode == "front" else "0"
            seconds, _floor, _phases = reform.p1(steps)
            times[mode].append(seconds)
            print(f"reform_seconds_{mode}_run: {seconds:.3f}", flush=True)
    access.STORE_FRONT = "1"
    front, bare = statistics.median(times["front"]), statistics.median(times["bare"])
    return {"reform_seconds_front": front, "reform_seconds_bare": bare, "reform_ratio": front / bare}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--only", choices=("trips", "reform"))
    args = parser.parse_args()
    figures: dict[str, float] = {}
    if args.only in (None, "trips"):
        figures.update(trips(args.ops))
    if args.only in (None, "reform"):
        figures.update(reforms(args.runs, args.steps))
    for key, value in figures.items():
        print(f"{key}: {value:.3f}")


if __name__ == "__main__":
    main()
