"""P5 of the local-mode issue, and issue 12 item 3: goodput under failures, fixed vs automatic checkpoint interval.

Runs of the tiny LM demo job on 3 nodes, the same wall-clock window measured from the first completed step: one
without failures, then two where a node's machine is killed every ``--period`` seconds (the runtime re-adds a
node each time, as a cluster would replace a machine): one with the demo's fixed ``intervalSteps`` (20), one with
``intervalSteps: auto`` (Young/Daly from the measured save cost and the failures the operator counted).
goodput_ratio = samples whose work was kept (status samplesConsumed at the end of the window: redone steps are
not counted twice) with failures / without. Goal: >= 0.95 at one kill per 60 s.

A fourth run, ``spare``, is the fixed interval with ``spec.nodes.spares: 1``: a hot spare waits warm in the
rendezvous, takes the lost node's place at once, and the replacement becomes the next spare. Its victims are
members of the group (a pod whose worker serves its metrics), never the idle spare.

``--replacement-wait S`` sets the job's ``spec.elastic.replacementWaitSeconds`` in every run (the demo's is 30: the
survivors wait for the replacement's cold start; 0: they re-form at once and the replacement joins once Ready).

    python bench/goodput.py [--window 130] [--period 60] [--replacement-wait S] [--rounds 3] [--spares 1]
"""

from __future__ import annotations

import argparse
import shutil
import time

import _localbench as lb


class Losses:
    """Where a run's seconds went at each loss: every reform's record (``status.lastReform``) and the steps redone
    (the relayed step falling back to the checkpoint the group resumed from)."""

    def __init__(self) -> None:
        self.reforms: dict[str, dict] = {}
        self.redone: list[int] = []
        self._highest = 0

    def observe(self, status: dict) -> None:
        record = status.get("lastReform") or {}
        if record.get("start") and record.get("durationSeconds") is not None:
            self.reforms[record["start"]] = record
        step = int(status.get("step", 0))
        if 0 < step < self._highest:
            self.redone.append(self._highest - step)
        if step > 0:
            self._highest = step

    def new_run(self) -> None:
        """A new job starts at step 0: its steps are not redone steps of the run before."""
        self._highest = 0

    def lines(self) -> list[str]:
        out = []
        for record in sorted(self.reforms.values(), key=lambda r: r["start"]):
            phases = ", ".join(f"{k} {v:.2f}" for k, v in (record.get("phases") or {}).items() if v)
            out.append(
                f"  reform {record['reason']} {record.get('from')}->{record.get('to')}: "
                f"{record['durationSeconds']:.2f} s ({phases})"
            )
        out.append(f"  steps redone after each loss: {self.redone}")
        return out


def measure(
    window: float,
    period: float | None,
    interval: int | str | None = None,
    replacement_wait: int | None = None,
    losses: Losses | None = None,
    spares: int = 0,
) -> tuple[float, int, dict, dict]:
    """(kept samples per second, kills, restarts by reason, the last status.checkpointInterval)."""
    base = lb.workdir("goodput")
    if losses is not None:
        losses.new_run()
    marks: dict[str, float] = {}
    kills: list[float] = []
    chosen: dict = {}

    def on_tick(runtime, snapshot):
        status = snapshot.status
        now = time.time()
        if losses is not None:
            losses.observe(status)
        if status.get("checkpointInterval"):
            chosen.update(status["checkpointInterval"])
        if "start" not in marks and status.get("step", 0) > 0 and all(
            p.probed_ready for p in runtime.workers.values() if p.is_alive
        ):
            marks["start"] = now  # once every pod is up: a hot spare's first start is not part of the window
        if "start" not in marks:
            return
        if period and now - marks["start"] >= period * (len(kills) + 1) - period / 2:
            kills.append(now)
            alive = [p for p in runtime.workers.values() if p.is_alive and not p.node_lost and p.index != 0]
            alive = [p for p in alive if p.is_training()] if spares else alive
            if alive:
                runtime.apply_chaos(lb.parse_chaos(f"kill-node:{max(p.index for p in alive)}@0s")[0])
        if now - marks["start"] >= window:
            marks["samples"] = status.get("samplesConsumed", 0)
            marks["steps"] = status.get("step", 0)
            runtime.stop(f"window of {window:.0f}s elapsed")

    job = lb.tinylm_job("goodput", replicas=3, max_steps=1_000_000)
    if interval is not None:
        job["spec"]["checkpoint"]["intervalSteps"] = interval
    if replacement_wait is not None:
        job["spec"]["elastic"]["replacementWaitSeconds"] = replacement_wait
    job["spec"]["nodes"]["spares"] = spares
    runtime = lb.run(job, base / "state", on_tick=on_tick, timeout_s=window + 300)
    restarts = dict(runtime.summary.restarts_by_reason)
    shutil.rmtree(base, ignore_errors=True)
    return marks.get("samples", 0) / window, len(kills), restarts, chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window", type=float, default=130.0, help="seconds measured in each run")
    parser.add_argument("--period", type=float, default=60.0, help="seconds between node kills")
    parser.add_argument(
        "--replacement-wait", type=int, help="spec.elastic.replacementWaitSeconds (default: the demo's)"
    )
    parser.add_argument("--spares", type=int, default=1, help="spec.nodes.spares of the spare run")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of the three runs, each round in another order; the ratios are of the summed rates (this "
        "machine's throughput drifts by 20%% between runs minutes apart, more than the gap to the goal)",
    )
    args = parser.parse_args()
    backend = lb.use_registered_backend()
    wait = args.replacement_wait
    kinds = ["clean", "fixed", "auto", "spare"]
    losses_of = {kind: Losses() for kind in kinds[1:]}
    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    kills: dict[str, int] = {kind: 0 for kind in kinds[1:]}
    restarts: dict[str, dict] = {kind: {} for kind in kinds[1:]}
    chosen: dict = {}
    for round_ in range(args.rounds):
        turn = round_ % len(kinds)
        for kind in kinds[turn:] + kinds[:turn]:
            if kind == "clean":
                rate, _, _, _ = measure(args.window, None, replacement_wait=wait)
            else:
                interval = "auto" if kind == "auto" else None
                spares = args.spares if kind == "spare" else 0
                rate, killed, by_reason, last = measure(
                    args.window, args.period, interval, replacement_wait=wait, losses=losses_of[kind], spares=spares
                )
                kills[kind] += killed
                for reason, count in by_reason.items():
                    restarts[kind][reason] = restarts[kind].get(reason, 0) + count
                if kind == "auto":
                    chosen.update(last)
            rates[kind].append(rate)
            print(f"round {round_ + 1} {kind}: {rate:.1f} samples/s", flush=True)
    clean, fixed, auto, spare = (sum(rates[kind]) / len(rates[kind]) for kind in kinds)
    print(f"rendezvous backend: {backend}; {kills['fixed']} node kills in {args.rounds} x {args.window:.0f}s")
    for kind in kinds[1:]:
        print(f"{kind} runs: {kills[kind]} node kills; restarts {restarts[kind]}")
        if kind == "auto":
            print(f"last status.checkpointInterval of an auto run: {chosen}")
        print("\n".join(losses_of[kind].lines()))
    print(f"samples_per_second_clean: {clean:.1f}")
    print(f"samples_per_second_with_failures: {fixed:.1f}")
    print(f"samples_per_second_with_failures_auto_interval: {auto:.1f}")
    print(f"samples_per_second_with_failures_spare: {spare:.1f}")
    print(f"goodput_ratio: {fixed / clean:.3f}")
    print(f"goodput_ratio_auto_interval: {auto / clean:.3f}")
    print(f"goodput_ratio_spare: {spare / clean:.3f}")


if __name__ == "__main__":
    main()
