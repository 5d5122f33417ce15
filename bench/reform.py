"""P1 and P2 of the local-mode issue: how long a reform takes, and how much work planned reforms lose.

P1, reform time: 3 nodes train; one node's machine dies (SIGKILL of torchrun and its worker) while the desired
size drops to 2, as when an autoscaler removes a machine. reform_seconds = from the kill to the first step
completed at the new size, minus the checkpoint load time. floor_seconds, measured in the same run: a fresh
group started directly at 2 nodes from the same checkpoint, from starting its nodes to its first step, minus
the load time. Goal: reform <= 5 s and <= 2x the floor.

detect_seconds: 3 nodes train; one node's machine dies, and its node reads NotReady only 20 s later (as
Kubernetes' node-monitor-grace-period), so the figure is independent of it: from the kill to the operator's reform
directive in the job's status, found from the rendezvous heartbeats. Goal: <= 4 s.

P2, lost work on planned scale-down (3 -> 2) and scale-up (2 -> 3): optimizer steps executed twice. Goal: 0.
scale_up_stall_seconds, same run: how long the running 2-node group stops training for the joining node, from its
last step to the first step at 3 nodes. The joining node starts cold (a new pod), so this shows whether the group
waits for its imports (it should not: the drain comes only once the node is Ready, its workers' interpreters warm).

    python bench/reform.py [--steps N] [--only detect|p1|p2]
"""

from __future__ import annotations

import argparse
import shutil
import time

import _localbench as lb


def p1(steps: int) -> tuple[float, float, dict[str, float]]:
    base = lb.workdir("reform")
    out = base / "records"
    kill_at: dict[str, float] = {}
    phases: dict[str, float] = {}

    def kill_and_shrink(runtime, snapshot):
        status = snapshot.status
        if kill_at and not phases:
            phases.update((status.get("lastReform") or {}).get("phases") or {})
        if not kill_at and status.get("phase") == "Running" and status.get("step", 0) >= 12:
            runtime.set_replicas(2, "the machine is gone for good")
            kill_at["t"] = time.time()
            victim = max(runtime.workers.values(), key=lambda p: p.index)
            runtime.apply_chaos(lb.parse_chaos(f"kill-node:{victim.index}@0s")[0])

    lb.run(
        lb.recorder_job("reform", out, replicas=3, max_steps=steps, step_sleep=0.05),
        base / "state",
        on_tick=kill_and_shrink,
    )
    found = lb.records(out)
    after = [r for r in found if r["time"] > kill_at["t"] and r["world"] == 2]
    first = min(after, key=lambda r: r["time"])
    reform = first["time"] - kill_at["t"] - first["load_seconds"]
    resumed_from = first["resumed_from"]

    # The floor: a fresh 2-node group from the same checkpoint (everything after it removed).
    floor_base = lb.workdir("floor")
    (floor_base / "state").mkdir()
    shutil.copytree(base / "state" / "checkpoints", floor_base / "state" / "checkpoints")
    for path in (floor_base / "state" / "checkpoints").iterdir():
        if path.name.startswith("step-") and int(path.name.split("-")[1]) > resumed_from:
            shutil.rmtree(path)
    floor_out = floor_base / "records"
    started: dict[str, float] = {}

    def note_start(runtime, snapshot):
        if "t" not in started and runtime.workers:
            started["t"] = min(p.created_at for p in runtime.workers.values())

    state = lb.StateDir(floor_base / "state")
    # The same dataset as the run it resumes (the trainer refuses a checkpoint of another dataset stream).
    job = lb.recorder_job(
        "floor", floor_out, replicas=2, max_steps=resumed_from + 3, step_sleep=0.05, dataset=12 * steps
    )
    options = lb.RunOptions(workdir=str(lb.REPO), on_tick=lambda snap: note_start(runtime, snap))
    runtime = lb.LocalRuntime(lb.DistTrainJob.model_validate(job), state, options)
    runtime.run(timeout_s=300)
    first_floor = min(lb.records(floor_out), key=lambda r: r["time"])
    floor = first_floor["time"] - started["t"] - first_floor["load_seconds"]
    shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(floor_base, ignore_errors=True)
    return reform, floor, phases


NOT_READY_DELAY_S = 20.0


def detect(steps: int) -> tuple[float, str]:
    """Seconds from a node's death to the reform directive in status, and the directive's reason."""
    base = lb.workdir("detect")
    seen: dict[str, object] = {}

    def kill_and_watch(runtime, snapshot):
        status = snapshot.status
        if "kill" not in seen and status.get("phase") == "Running" and status.get("step", 0) >= 12:
            victim = max(runtime.workers.values(), key=lambda p: p.index)
            seen["kill"] = time.time()
            runtime.apply_chaos(lb.parse_chaos(f"kill-node:{victim.index}@0s")[0])
        control = status.get("control") or {}
        if "kill" in seen and "directive" not in seen and control.get("action") == "reform":
            seen["directive"], seen["reason"] = time.time(), control.get("reason", "")
            runtime.stop("detection measured")

    lb.run(
        lb.recorder_job("detect", base / "records", replicas=3, max_steps=steps, step_sleep=0.05),
        base / "state",
        on_tick=kill_and_watch,
        not_ready_delay_s=NOT_READY_DELAY_S,
    )
    shutil.rmtree(base, ignore_errors=True)
    if "directive" not in seen:
        raise SystemExit("no reform directive after the kill; raise --steps")
    return float(seen["directive"]) - float(seen["kill"]), str(seen["reason"])


def p2(steps: int) -> tuple[int, int, float]:
    base = lb.workdir("planned")
    out = base / "records"
    plan = [2, 3]
    marks: dict[str, object] = {"world": None, "step": 0, "done": []}
    split: dict[int, float] = {}

    def scaler(runtime, snapshot):
        status = snapshot.status
        if status.get("phase") != "Running":
            return
        world, step = status.get("worldSize"), status.get("step", 0)
        if marks["world"] != world:
            marks["world"], marks["step"] = world, step
            return
        if plan and step >= marks["step"] + 5:
            size = plan.pop(0)
            split[size] = time.time()
            runtime.state.request_scale(size)
            marks["world"] = None

    lb.run(
        lb.recorder_job("planned", out, replicas=3, max_steps=steps, step_sleep=0.05), base / "state", on_tick=scaler
    )
    found = lb.records(out)
    if plan:
        raise SystemExit(f"the run ended before every scale request was made (left: {plan}); raise --steps")
    down = [r for r in found if r["time"] < split[3]]
    up = [r for r in found if r["time"] >= split[2]]
    at_3 = [r["time"] for r in up if r["world"] == 3 and r["time"] > split[3]]
    if not at_3:
        raise SystemExit("the run ended before a step at 3 nodes; raise --steps")
    first_at_3 = min(at_3)
    last_at_2 = max(r["time"] for r in up if r["world"] == 2 and r["time"] < first_at_3)
    shutil.rmtree(base, ignore_errors=True)
    return lb.lost_steps(down), lb.lost_steps(up), first_at_3 - last_at_2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)  # 150 ran out before the scale-up once reforms were in place
    parser.add_argument("--only", choices=("detect", "p1", "p2"), help="run one part (default: all)")
    args = parser.parse_args()
    backend = lb.use_registered_backend()
    began = time.time()
    lines: list[str] = []
    if args.only in (None, "detect"):
        detected, detect_reason = detect(args.steps)
        lines.append(
            f"detect_seconds: {detected:.2f} (reason {detect_reason}; NotReady after {NOT_READY_DELAY_S:.0f} s)"
        )
    if args.only in (None, "p1"):
        reform, floor, phases = p1(args.steps)
        lines.append(f"reform_seconds: {reform:.2f}")
        for phase, seconds in phases.items():  # status.lastReform.phases: from the first sign of the loss
            lines.append(f"reform_seconds.{phase}: {seconds:.2f}")
        lines += [f"floor_seconds: {floor:.2f}", f"reform_vs_floor: {reform / floor:.2f}"]
    if args.only in (None, "p2"):
        down, up, stall = p2(args.steps)
        lines += [
            f"lost_steps_scale_down: {down}",
            f"lost_steps_scale_up: {up}",
            f"scale_up_stall_seconds: {stall:.2f}",
        ]
    print(f"rendezvous backend: {backend}; bench wall time {time.time() - began:.0f}s")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
