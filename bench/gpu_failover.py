"""GPU failover: what a lost peer and a stuck reduction cost on NCCL, measured end to end in local mode.

    python bench/gpu_failover.py [--scenario auto|kill|abort] [--device cuda|cpu] [--nodes 2] [--steps 200]
                                 [--kill-at 60] [--stall-at 30,70] [--width 2048] [--depth 4] [--micro-batch 64]

Two scenarios; ``--scenario auto`` (the default) runs ``kill`` where every rank of ``--nodes`` nodes gets a GPU of
its own, else ``abort``:

**kill** (2+ GPUs, or ``--device cpu``). One invocation runs, one after the other, with the same model, data and
batch: (a) the job uninterrupted (local mode: reconcile, job agent, torchrun, the trainer); (b) the same job with
the last node SIGKILLed (its whole process tree, as ``--chaos kill-node`` does) while its rank is inside step
``--kill-at``: it stops before the backward that reaches the gradient reduction, so its peers wait in the collective
when it dies, as when a machine dies mid-step; (c) a plain DDP loop (torchrun, no disttrain): the step-time
baseline. Every local node runs on GPUs of its own (the local runtime gives each a ``CUDA_VISIBLE_DEVICES`` slice).
Prints ``reform_seconds``, ``lost_steps``, ``group_leave``/``nccl_abort_seconds``, ``restarts_charged``,
``step_time_ratio`` and the loss trajectory against (a).

**abort** (one GPU: NCCL refuses two ranks of one group on one device, so no peer can be killed). One node, one
process, ``spec.elastic.reformInPlace``, a short collective timeout. At each step of ``--stall-at`` (once each) the
rank queues a device kernel that spins for longer than the collective timeout (``torch.cuda._sleep``) just before
its last backward: the step's reductions are queued behind it and cannot start, as behind a peer that never comes.
NCCL's watchdog times them out and aborts the communicator while they are in flight. Prints whether the aborted step
counted (``aborted_step_counted``: the next group must redo it), how the rank left the group and how long that took,
whether it re-formed in place (same process), the time to the next group's first step, and the flight recorder's
dumps: the first group's (torch's own, uid 0) and the re-formed group's (the second stall; docs/gpu.md, "The flight
recorder of a re-formed group").

Every figure is one ``key: value`` line on stdout, the last lines of the output. Without a CUDA device (and without
``--device cpu``) it prints ``skipped: ...`` and exits 0: nothing was measured.

On the device machine (no network: only its own torch, the checkout, and the wheels this project lacks there,
carried in the git-ignored ``.whl/``, ``carry: [".whl"]``), the one prepared command::

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && \\
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 && \\
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . && \\
    timeout 480 python3 bench/gpu_failover.py --steps 120 --kill-at 40 --timeout 200 2>&1 | tail -40

(not yet run on a GPU). Here, to check the kill scenario on the CPU:
``python bench/gpu_failover.py --device cpu --steps 40 --kill-at 15``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, Optional

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = "bench/gpu_failover.py"
INPUT_DIM = 128
KILL_MARKER = "kill-marker"
"""File the victim's rank writes once it is held inside the kill step; the driver then kills its node."""
LEAVE_EVENT = "leave"
STALL_EVENT = "stall"
GROUP_EVENT = "group"


# ---- pure parts: records to figures ---------------------------------------------------------------------------------


def step_records(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The per-step records (other events, such as a group leave, carry no ``step``)."""
    return [r for r in records if "step" in r]


def executions(records: Iterable[Mapping[str, Any]]) -> dict[int, list[list[Mapping[str, Any]]]]:
    """step -> its executions in time order; an execution is the records of one group (one per rank)."""
    by_group: dict[tuple[int, str], list[Mapping[str, Any]]] = collections.defaultdict(list)
    for record in step_records(records):
        by_group[(record["step"], record["group"])].append(record)
    ordered = sorted(by_group.items(), key=lambda kv: min(r["time"] for r in kv[1]))
    steps: dict[int, list[list[Mapping[str, Any]]]] = collections.defaultdict(list)
    for (step, _group), found in ordered:
        steps[step].append(found)
    return dict(steps)


def lost_steps(records: Iterable[Mapping[str, Any]], last_step: int) -> tuple[int, int]:
    """(steps executed again by a later group, steps in 1..``last_step`` never executed): the work a failure cost."""
    runs = executions(records)
    redone = sum(len(found) - 1 for found in runs.values())
    missing = sum(1 for step in range(1, last_step + 1) if step not in runs)
    return redone, missing


class StepLoss(NamedTuple):
    loss: float
    world: int


def final_losses(records: Iterable[Mapping[str, Any]]) -> dict[int, StepLoss]:
    """step -> the mean loss of the execution that counted (the last one) and its world size."""
    out = {}
    for step, found in executions(records).items():
        last = found[-1]
        count = sum(r["count"] for r in last)
        out[step] = StepLoss(sum(r["loss_sum"] for r in last) / count, last[0]["world"])
    return dict(sorted(out.items()))


class TrajectoryDiff(NamedTuple):
    steps: int
    """Steps compared (after the kill, present in both runs)."""
    max_abs: float
    same_world_steps: int
    max_abs_same_world: float
    bitwise_same_world: bool
    """Every compared step at the reference's world size has exactly the reference's loss."""


def trajectory_diff(reference: Mapping[int, StepLoss], other: Mapping[int, StepLoss], after: int) -> TrajectoryDiff:
    """How far ``other``'s losses are from ``reference``'s at every step after ``after`` that both ran."""
    steps = [s for s in sorted(other) if s > after and s in reference]
    diffs = {s: abs(other[s].loss - reference[s].loss) for s in steps}
    same = [s for s in steps if other[s].world == reference[s].world]
    return TrajectoryDiff(
        steps=len(steps),
        max_abs=max(diffs.values(), default=0.0),
        same_world_steps=len(same),
        max_abs_same_world=max((diffs[s] for s in same), default=0.0),
        bitwise_same_world=all(other[s].loss == reference[s].loss for s in same),
    )


def median_step_ms(times: list[float], skip: int = 3) -> float:
    """Median interval between consecutive step times (seconds), in ms, after ``skip`` warm-up steps."""
    gaps = [b - a for a, b in zip(times[skip:], times[skip + 1 :], strict=False)]
    if not gaps:
        raise ValueError(f"{len(times)} step times: too few to time a step after {skip} warm-up steps; raise --steps")
    return statistics.median(gaps) * 1000.0


def rank0_step_times(records: Iterable[Mapping[str, Any]]) -> list[float]:
    """Times of global rank 0's records, one per step, of a run without failures."""
    return [r["time"] for r in sorted(step_records(records), key=lambda r: r["time"]) if r["rank"] == 0]


def first_step_after(records: Iterable[Mapping[str, Any]], at: float, old_groups: set[str]) -> Optional[float]:
    """Time of the first step record after ``at`` by a group other than ``old_groups``."""
    times = [r["time"] for r in step_records(records) if r["time"] > at and r["group"] not in old_groups]
    return min(times, default=None)


class Scenario(NamedTuple):
    name: str
    """``kill`` (a node SIGKILLed) or ``abort`` (a reduction aborted by NCCL's watchdog, one node)."""
    nodes: int
    note: str
    """Why ``auto`` chose ``abort`` (empty otherwise)."""


def plan_scenario(requested: str, device: str, gpus: int, nodes: int, nproc: int) -> Scenario:
    """What can run: every rank needs a GPU of its own (NCCL refuses two ranks of one group on one device), so
    ``kill`` needs ``nodes x nproc`` GPUs; ``abort`` needs one node's worth and CUDA (gloo has no watchdog to abort a
    reduction, and the CPU no device kernel to stall it)."""
    if requested == "abort" or (requested == "auto" and device == "cuda" and gpus < nodes * nproc):
        if device != "cuda":
            raise SystemExit("gpu_failover: --scenario abort needs CUDA (a device kernel stalls the reduction)")
        if gpus < nproc:
            raise SystemExit(f"gpu_failover: {gpus} GPU(s) < --nproc-per-node={nproc}; nothing was run")
        note = (
            f"{gpus} GPU(s) < {nodes} nodes x {nproc} processes: no peer can be killed (NCCL cannot put two ranks "
            "of one group on one device), so one node runs the watchdog-abort scenario"
            if requested == "auto"
            else ""
        )
        return Scenario("abort", 1, note)
    if device == "cuda" and gpus < nodes * nproc:
        raise SystemExit(f"gpu_failover: --scenario kill needs {nodes} x {nproc} GPUs, {gpus} found; nothing was run")
    return Scenario("kill", nodes, "")


def parse_steps(text: str) -> tuple[int, ...]:
    """``--stall-at``: step numbers, comma-separated, ascending."""
    try:
        steps = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise ValueError(f"--stall-at={text!r}: comma-separated step numbers, such as 30,70") from exc
    if not steps or list(steps) != sorted(set(steps)) or steps[0] < 2:
        raise ValueError(f"--stall-at={text!r}: ascending step numbers from 2")
    return steps


def sleep_cycles(seconds: float, cycles_per_second: float) -> int:
    """``torch.cuda._sleep``'s argument for a kernel that spins ``seconds`` on a GPU running at this clock."""
    return max(1, int(seconds * cycles_per_second))


class AbortOutcome(NamedTuple):
    counted: Optional[bool]
    """Whether the stalled step counted: the next group started after it (True) or redid it (False); None when no
    new group ran."""
    next_group_first_step: Optional[int]
    next_group_seconds: Optional[float]
    """From the stall to the next group's first step."""
    same_process: Optional[bool]
    """The next group's rank ran in the stalled rank's process (re-formed in place)."""


def abort_outcome(records: Iterable[Mapping[str, Any]], stall: Mapping[str, Any]) -> AbortOutcome:
    """What became of step ``stall['step']``, stalled at ``stall['time']`` by process ``stall['pid']``."""
    steps = step_records(records)
    stalled = [r for r in steps if r["step"] == stall["step"] and r["time"] <= stall["time"] + 1e-6]
    old = {r["group"] for r in stalled} or {None}
    later = sorted((r for r in steps if r["time"] > stall["time"] and r["group"] not in old), key=lambda r: r["time"])
    if not later:
        return AbortOutcome(None, None, None, None)
    first = later[0]
    return AbortOutcome(
        first["step"] > stall["step"], first["step"], first["time"] - stall["time"], first.get("pid") == stall["pid"]
    )


def dumps_written_after(files: Mapping[str, tuple[float, int]], at: float) -> dict[str, tuple[float, int]]:
    """The flight-recorder files (name -> (mtime, bytes)) written after ``at``."""
    return {name: found for name, found in sorted(files.items()) if found[0] > at and found[1] > 0}


def flight_recorder_files(folder: pathlib.Path) -> dict[str, tuple[float, int]]:
    """name -> (mtime, bytes) of the dumps in ``folder`` (torch's ``nccl_trace_rank_<rank>``)."""
    found = {}
    for path in sorted(folder.glob("nccl_trace_rank_*")):
        if path.is_file() and ".tmp" not in path.name:
            stat = path.stat()
            found[path.name] = (stat.st_mtime, stat.st_size)
    return found


# ---- the model, shared by the nodes' program and the plain DDP loop --------------------------------------------------


def build_model(width: int, depth: int) -> Any:
    import torch

    torch.manual_seed(1234)  # the same initial weights on every rank and in every run
    layers: list[torch.nn.Module] = [torch.nn.Linear(INPUT_DIM, width), torch.nn.Tanh()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1), torch.nn.Flatten(0))


def build_dataset(samples: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(7)
    x = torch.randn(samples, INPUT_DIM, generator=g)
    y = x[:, :8].sum(-1) * 0.3 + torch.randn(samples, generator=g) * 0.1
    return torch.utils.data.TensorDataset(x, y)


# ---- (a) and (b): the nodes' program ---------------------------------------------------------------------------------


def worker() -> None:
    """One rank of a local node: train, and append one JSON line per step (and per group leave, stall, new group) to
    ``GF_OUT``. The local runtime gave the node its own GPUs (``CUDA_VISIBLE_DEVICES``)."""
    index = int(os.environ.get("DISTTRAIN_NODE_INDEX", "0"))
    import torch
    import torch.distributed as dist

    from disttrain.trainer import teardown
    from disttrain.trainer.loop import ElasticTrainer

    out = pathlib.Path(os.environ["GF_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    kill_at = int(os.environ.get("GF_KILL_AT", "0"))
    victim = kill_at and index == int(os.environ["GF_VICTIM"]) and not (out / KILL_MARKER).exists()
    stalls = parse_steps(os.environ["GF_STALL_AT"]) if os.environ.get("GF_STALL_AT") else ()
    fr_folder = pathlib.Path(os.environ.get("TORCH_FR_DUMP_TEMP_FILE", "/nonexistent/x")).parent
    model = build_model(int(os.environ["GF_WIDTH"]), int(os.environ["GF_DEPTH"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = build_dataset(int(os.environ["GF_SAMPLES"]))
    with (
        open(out / f"node{index}-{os.getpid()}.jsonl", "a", buffering=1) as records,  # line-buffered: a kill loses none
        ElasticTrainer.from_env(model, optimizer, dataset) as trainer,
    ):
        _time_group_leaves(teardown, records)
        cycles_per_second = _gpu_clock(torch) if stalls else 0.0
        seen_group = ""
        for step in trainer.steps():
            env = os.environ  # re-read: a worker re-formed in place runs in the next round's environment
            group = f"{env.get('TORCHELASTIC_RUN_ID')}:{env.get('MASTER_PORT')}:{trainer.world_size}"
            group += f":{trainer.resumed_from}"
            if group != seen_group:
                seen_group = group
                event = {"event": GROUP_EVENT, "group": group, "time": time.time(), "pid": os.getpid()}
                event["fr"] = flight_recorder_files(fr_folder)
                records.write(json.dumps(event) + "\n")
            loss_sum, count = 0.0, 0
            last = len(step.micro_indices) - 1
            for i, mb in enumerate(step):
                xb, yb = mb.data
                loss = torch.nn.functional.mse_loss(trainer.model(xb), yb, reduction="sum")
                loss_sum += float(loss.detach())
                count += len(mb.indices)
                if i == last:
                    if victim and step.index + 1 == kill_at:
                        (out / KILL_MARKER).write_text(str(time.time()))
                        time.sleep(600)  # held before the gradient reduction until the node is killed
                    record: dict[str, Any] = {"step": step.index + 1, "rank": trainer.rank, "world": trainer.world_size}
                    record.update(group=group, loss_sum=loss_sum, count=count, time=time.time(), pid=os.getpid())
                    records.write(json.dumps(record) + "\n")
                    if step.index + 1 in stalls and not (out / f"stall-{step.index + 1}").exists():
                        _stall(torch, dist, out, records, step.index + 1, cycles_per_second, trainer.device)
                step.backward(loss)


def _gpu_clock(torch: Any) -> float:
    """Cycles per second of ``torch.cuda._sleep`` on this GPU, timed with CUDA events."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(100_000_000)
    end.record()
    end.synchronize()
    return 100_000_000 / (start.elapsed_time(end) / 1000.0)


def _stall(torch: Any, dist: Any, out: pathlib.Path, records: Any, step: int, clock: float, device: Any) -> None:
    """Queue a kernel that spins ``GF_STALL_S`` seconds, then a reduction behind it: the step's reductions cannot start
    before the collective timeout, so NCCL's watchdog aborts them in flight (once per step number: a redone step
    runs free)."""
    (out / f"stall-{step}").write_text(str(time.time()))
    seconds = float(os.environ["GF_STALL_S"])
    event = {"event": STALL_EVENT, "step": step, "time": time.time(), "pid": os.getpid(), "seconds": seconds}
    records.write(json.dumps(event) + "\n")
    torch.cuda._sleep(sleep_cycles(seconds, clock))
    dist.all_reduce(torch.ones(1, device=device))  # a reduction of this step even where DDP has none to run


def _time_group_leaves(teardown: Any, records: Any) -> None:
    """Wrap the teardown's abort and destroy so a survivor records when it left a group and how long it took."""

    def timed(how: str, original: Any) -> Any:
        def leave() -> None:
            began = time.time()
            try:
                original()
            finally:
                event = {"event": LEAVE_EVENT, "how": how, "began": began, "seconds": time.time() - began}
                records.write(json.dumps(event) + "\n")

        return leave

    teardown.abort_groups = timed("abort", teardown.abort_groups)
    teardown.destroy_groups = timed("destroy", teardown.destroy_groups)


# ---- (c): the plain DDP loop -----------------------------------------------------------------------------------------


def plain_ddp(width: int, depth: int, micro_batch: int, steps: int) -> None:
    """One rank of plain DDP under torchrun: the same model, per-rank batch and loss; rank 0 prints its step time."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    cuda = os.environ.get("GF_DEVICE") == "cuda"
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    model = DistributedDataParallel(build_model(width, depth).to(device), device_ids=[local] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = build_dataset(micro_batch * world * steps)
    times = []
    for step in range(steps):
        at = (step * world + rank) * micro_batch
        xb, yb = (t[at : at + micro_batch].to(device) for t in data.tensors)
        loss = torch.nn.functional.mse_loss(model(xb), yb, reduction="sum")
        float(loss.detach())  # the same host sync per step as the nodes' program
        (loss / micro_batch).backward()  # DDP averages over the ranks: the global mean
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.time())
    if rank == 0:
        print(f"plain_ddp_step_time_ms {median_step_ms(times):.3f}", flush=True)
    dist.destroy_process_group()


# ---- the driver ------------------------------------------------------------------------------------------------------


def localbench() -> Any:
    """``bench/_localbench.py``, imported by the driver only: the workers have no use for the local runtime."""
    sys.path.insert(0, str(REPO / "bench"))
    import _localbench

    return _localbench


def job(
    name: str, out: pathlib.Path, args: argparse.Namespace, nodes: int, kill_at: int, stall: bool = False
) -> dict[str, Any]:
    """The DistTrainJob of one run; ``stall``: the abort scenario's (stalls at ``--stall-at``, in-place reforms, a
    short collective timeout and dump wait)."""
    global_batch = args.micro_batch * nodes * args.nproc_per_node
    env = {
        "GF_OUT": str(out),
        "GF_DEVICE": args.device,
        "GF_NPROC": str(args.nproc_per_node),
        "GF_WIDTH": str(args.width),
        "GF_DEPTH": str(args.depth),
        "GF_SAMPLES": str(global_batch * args.steps),
        "GF_KILL_AT": str(kill_at),
        "GF_VICTIM": str(nodes - 1),
    }
    timeout = args.collective_timeout
    if stall:
        env["GF_STALL_AT"] = args.stall_at
        env["GF_STALL_S"] = str(stall_seconds(timeout))
        env["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] = str(DUMP_WAIT_MS)
    container: dict[str, Any] = {
        "name": "trainer",
        "image": "local",
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "command": ["python", "-u", SCRIPT, "--worker"],
    }
    if args.device == "cuda":
        container["resources"] = {"limits": {"nvidia.com/gpu": args.nproc_per_node}}
    else:
        container["env"].append({"name": "CUDA_VISIBLE_DEVICES", "value": ""})
    return localbench().local_job(
        name,
        container,
        nodes={"max": nodes, "replicas": nodes},
        nprocPerNode=args.nproc_per_node,
        training={
            "globalBatchSize": global_batch,
            "microBatchSize": args.micro_batch,
            "lr": {"base": 0.01},
            "maxSteps": args.steps,
            "seed": 3,
        },
        checkpoint={"intervalSteps": args.checkpoint_interval},
        elastic={
            "replacementWaitSeconds": args.replacement_wait,
            "collectiveTimeoutSeconds": timeout,
            "reformInPlace": stall or args.in_place,
        },
        restartPolicy={"maxRestarts": 10},
    )


DUMP_WAIT_MS = 1000
"""The abort scenario's ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``: the watchdog sleeps four of these between the
timeout and the abort."""


def stall_seconds(collective_timeout_s: int, dump_wait_ms: int = DUMP_WAIT_MS) -> float:
    """How long a stall spins on the device: past the collective timeout, the watchdog's four dump waits and a
    margin, so the reductions behind it are still queued when the watchdog aborts them."""
    return collective_timeout_s + 4 * dump_wait_ms / 1000.0 + 10.0


def read_records(out: pathlib.Path) -> list[dict[str, Any]]:
    found = []
    for path in sorted(out.glob("*.jsonl")):
        found += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return found


class RunResult(NamedTuple):
    records: list[dict[str, Any]]
    status: dict[str, Any]
    phase: str
    kill_time: Optional[float]


def run_job(
    name: str, base: pathlib.Path, args: argparse.Namespace, nodes: int, kill_at: int, stall: bool = False
) -> RunResult:
    """Run one local-mode job to its end; with ``kill_at``, SIGKILL the last node once its rank is held in that step."""
    lb = localbench()
    out = base / name / "records"
    seen: dict[str, Any] = {"status": {}}

    def kill_when_held(runtime: Any, snapshot: Any) -> None:
        seen["status"] = snapshot.status
        if kill_at and "kill" not in seen and (out / KILL_MARKER).exists():
            seen["kill"] = time.time()
            runtime.apply_chaos(lb.parse_chaos(f"kill-node:{nodes - 1}@0s")[0])

    runtime: Any = lb.run(  # the runner sets .summary on the runtime it returns
        job(name, out, args, nodes, kill_at, stall),
        base / name / "state",
        on_tick=kill_when_held,
        timeout_s=args.timeout,
        gpus=gpu_slices(args, nodes),
    )
    return RunResult(read_records(out), seen["status"], runtime.summary.phase, seen.get("kill"))


def run_plain_ddp(args: argparse.Namespace, world: int) -> float:
    env = dict(os.environ, GF_DEVICE=args.device, OMP_NUM_THREADS="1")
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        SCRIPT,
        "--plain-ddp",
        f"--width={args.width}",
        f"--depth={args.depth}",
        f"--micro-batch={args.micro_batch}",
        f"--steps={args.steps}",
    ]
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=args.timeout, check=False)
    found = re.findall(r"^plain_ddp_step_time_ms ([\d.]+)$", done.stdout, re.M)
    if done.returncode != 0 or not found:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"gpu_failover: the plain DDP loop exited {done.returncode}")
    return float(found[-1])


def gpu_slices(args: argparse.Namespace, nodes: int) -> Any:
    """The machine's GPUs split between the local nodes, as ``disttrain local run`` splits them (None on the CPU)."""
    if args.device != "cuda":
        return None
    import torch

    from disttrain.operator.local import gpuslices

    mask = os.environ.get(gpuslices.VISIBLE_DEVICES_ENV)
    devices = gpuslices.visible_devices(mask, torch.cuda.device_count())
    return gpuslices.GpuSlices(devices, args.nproc_per_node)


def device_facts(device: str) -> Optional[tuple[int, str]]:
    """(GPUs, model) on CUDA; None where there is no CUDA device (nothing to measure)."""
    import torch

    if device == "cpu":
        return 0, "none (cpu, gloo)"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    return torch.cuda.device_count(), torch.cuda.get_device_name(0)


def kill_figures(args: argparse.Namespace, plan: Scenario, gpu_model: str) -> list[str]:
    """The kill scenario: (a) uninterrupted, (b) a node SIGKILLed inside ``--kill-at``, (c) plain DDP."""
    import tempfile

    base = pathlib.Path(tempfile.mkdtemp(prefix="disttrain-bench-gpu-failover-"))
    world = plan.nodes * args.nproc_per_node
    began = time.time()
    plain_ms = run_plain_ddp(args, world)
    clean = run_job("clean", base, args, plan.nodes, 0)
    killed = run_job("killed", base, args, plan.nodes, args.kill_at)
    for name, result in (("clean", clean), ("killed", killed)):
        if result.phase != "Succeeded":
            raise SystemExit(f"gpu_failover: run {name} ended {result.phase}; its state is in {base / name}")
    if killed.kill_time is None:
        raise SystemExit(f"gpu_failover: the kill never happened (step {args.kill_at} not reached?); see {base}")
    kill_time = killed.kill_time
    before = {r["group"] for r in step_records(killed.records) if r["time"] <= kill_time}
    first_new = first_step_after(killed.records, kill_time, before)
    redone, missing = lost_steps(killed.records, args.steps)
    leaves = [r for r in killed.records if r.get("event") == LEAVE_EVENT and r["began"] >= kill_time]
    leave = min(leaves, key=lambda r: r["began"]) if leaves else None
    step_ms = median_step_ms(rank0_step_times(clean.records))
    diff = trajectory_diff(final_losses(clean.records), final_losses(killed.records), args.kill_at - 1)
    restarts = (killed.status.get("restarts") or {}).get("total", 0)
    phases = (killed.status.get("lastReform") or {}).get("phases") or {}
    lines = [
        f"note: {plan.note}" if plan.note else "",
        f"bench_wall_seconds: {time.time() - began:.0f} (records under {base})",
        f"device: {args.device}",
        "scenario: kill",
        f"gpu_model: {gpu_model}",
        f"nodes: {plan.nodes}",
        f"nproc_per_node: {args.nproc_per_node}",
        f"model: width={args.width} depth={args.depth} micro_batch={args.micro_batch} steps={args.steps}",
        f"reform_seconds: {first_new - kill_time:.2f}"
        if first_new is not None
        else "reform_seconds: n/a (no new group)",
        f"lost_steps: {redone + missing} (redone {redone}, never run {missing})",
        f"group_leave: {leave['how'] if leave else 'none (no survivor left a group)'}",
        f"nccl_abort_seconds: {leave['seconds']:.3f}"
        if leave and leave["how"] == "abort"
        else "nccl_abort_seconds: n/a",
        f"survivor_leave_after_kill_seconds: {leave['began'] - kill_time:.2f}" if leave else "",
        f"group_leave_seconds: {leave['seconds']:.3f}" if leave else "",
        f"restarts_charged: {restarts}",
        f"reform_phases: {json.dumps(phases, sort_keys=True)}",
        f"step_time_ms: {step_ms:.3f}",
        f"plain_ddp_step_time_ms: {plain_ms:.3f}",
        f"step_time_ratio: {step_ms / plain_ms:.3f}",
        f"loss_steps_compared: {diff.steps} (same world size: {diff.same_world_steps})",
        f"max_abs_loss_diff: {diff.max_abs:.3e}",
        f"max_abs_loss_diff_same_world: {diff.max_abs_same_world:.3e}",
        f"bitwise_equal_same_world: {str(diff.bitwise_same_world).lower() if diff.same_world_steps else 'n/a'}",
    ]
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
        lines[1] = f"bench_wall_seconds: {time.time() - began:.0f}"
    return [line for line in lines if line]


def abort_figures(args: argparse.Namespace, plan: Scenario, gpu_model: str) -> list[str]:
    """The abort scenario: one node, its reductions stalled past the collective timeout at each ``--stall-at``."""
    import tempfile

    base = pathlib.Path(tempfile.mkdtemp(prefix="disttrain-bench-gpu-abort-"))
    began = time.time()
    run = run_job("stalled", base, args, 1, 0, stall=True)
    stalls = sorted((r for r in run.records if r.get("event") == STALL_EVENT), key=lambda r: r["time"])
    groups = sorted((r for r in run.records if r.get("event") == GROUP_EVENT), key=lambda r: r["time"])
    leaves = sorted((r for r in run.records if r.get("event") == LEAVE_EVENT), key=lambda r: r["began"])
    lines = [
        f"note: {plan.note}" if plan.note else "",
        f"bench_wall_seconds: {time.time() - began:.0f} (records under {base})",
        "scenario: abort",
        f"device: {args.device}",
        f"gpu_model: {gpu_model}",
        f"collective_timeout_seconds: {args.collective_timeout}",
        f"stall_seconds: {stall_seconds(args.collective_timeout):.0f} (device kernel before the last backward)",
        f"run_phase: {run.phase}",
        f"restarts_charged: {(run.status.get('restarts') or {}).get('total', 0)}",
    ]
    if not stalls:
        lines.append(f"stalls: 0 (step {args.stall_at} never reached; see {base})")
    for n, stall in enumerate(stalls, 1):
        outcome = abort_outcome(run.records, stall)
        leave = next((r for r in leaves if r["began"] >= stall["time"]), None)
        before_next = [g for g in groups if g["time"] > stall["time"]]
        fr = before_next[0]["fr"] if before_next else None
        if n == len(stalls):  # the last stall's dump: what the folder holds at the end
            fr = flight_recorder_files(_fr_folder(base / "stalled" / "state"))
        dumps = dumps_written_after(fr or {}, stall["time"])
        counted = "n/a (no next group)" if outcome.counted is None else str(outcome.counted).lower()
        lines += [
            f"stall{n}_step: {stall['step']}",
            f"stall{n}_aborted_step_counted: {counted}"
            + (
                f" (the next group began at step {outcome.next_group_first_step})"
                if outcome.counted is not None
                else ""
            ),
            f"stall{n}_group_leave: {leave['how'] if leave else 'none'}",
            f"stall{n}_leave_seconds: {leave['seconds']:.3f}" if leave else "",
            f"stall{n}_stall_to_leave_seconds: {leave['began'] - stall['time']:.2f}" if leave else "",
            f"stall{n}_next_group_first_step_seconds: {outcome.next_group_seconds:.2f}"
            if outcome.next_group_seconds is not None
            else "",
            f"stall{n}_reformed_in_place: {str(outcome.same_process).lower()}"
            if outcome.same_process is not None
            else "",
            f"stall{n}_flight_recorder_dump: "
            + (", ".join(f"{name} ({size} bytes)" for name, (_, size) in dumps.items()) or "none"),
        ]
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
        lines[1] = f"bench_wall_seconds: {time.time() - began:.0f}"
    return [line for line in lines if line]


def _fr_folder(state: pathlib.Path) -> pathlib.Path:
    """The node's flight-recorder folder in a local run's state (the launcher's ``<checkpoint dir>/flight-recorder/
    <node>``; one node)."""
    found = sorted((state / "checkpoints" / "flight-recorder").glob("*"))
    return found[0] if found else state / "checkpoints" / "flight-recorder"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--scenario",
        choices=("auto", "kill", "abort"),
        default="auto",
        help="kill: SIGKILL a node (a GPU per rank of --nodes); abort: stall one node's reductions past the collective "
        "timeout (one GPU); auto: kill where the GPUs suffice, else abort",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--kill-at", type=int, default=60, help="the step inside which the last node is killed")
    parser.add_argument(
        "--stall-at",
        default="",
        help="abort: the steps whose reductions are stalled past the timeout (default: a third and two thirds in); the "
        "first aborts the first group, the second the group re-formed after it",
    )
    parser.add_argument(
        "--collective-timeout", type=int, help="spec.elastic.collectiveTimeoutSeconds (default: 30 kill, 10 abort)"
    )
    parser.add_argument(
        "--in-place", action="store_true", help="kill: spec.elastic.reformInPlace (abort always re-forms in place)"
    )
    parser.add_argument("--width", type=int, help="hidden width (default: 2048 on cuda, 64 on cpu)")
    parser.add_argument("--depth", type=int, default=4, help="hidden layers")
    parser.add_argument("--micro-batch", type=int, default=64, help="samples per rank and step")
    parser.add_argument("--checkpoint-interval", type=int, default=10, help="spec.checkpoint.intervalSteps")
    parser.add_argument(
        "--replacement-wait",
        type=int,
        default=60,
        help="spec.elastic.replacementWaitSeconds: how long the survivors wait for the killed node's replacement "
        "before they go on without it (60: they re-form at full size, so every step compares at the same world size)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds each run may take")
    parser.add_argument("--keep", action="store_true", help="keep the records and state folders")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plain-ddp", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.width is None:
        args.width = 2048 if args.device == "cuda" else 64
    if not args.stall_at:
        args.stall_at = f"{max(2, args.steps // 3)},{max(3, 2 * args.steps // 3)}"
    if args.worker or args.plain_ddp:
        return args
    if not 1 < args.kill_at < args.steps:
        parser.error(f"--kill-at={args.kill_at} must lie between 1 and --steps={args.steps} (both excluded)")
    try:
        stalls = parse_steps(args.stall_at)
    except ValueError as exc:
        parser.error(str(exc))
    if stalls[-1] >= args.steps:
        parser.error(f"--stall-at={args.stall_at}: every step must come before --steps={args.steps}")
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        worker()
        return
    if args.plain_ddp:
        plain_ddp(args.width, args.depth, args.micro_batch, args.steps)
        return
    facts = device_facts(args.device)
    if facts is None:
        print("skipped: no CUDA device here (torch.cuda.is_available() is False): nothing was measured")
        print("hint: --device cpu runs the kill scenario with gloo, to check the script")
        return
    gpus, gpu_model = facts
    plan = plan_scenario(args.scenario, args.device, gpus, args.nodes, args.nproc_per_node)
    if plan.note:
        print(f"gpu_failover: {plan.note}", file=sys.stderr)
    if args.collective_timeout is None:
        args.collective_timeout = 10 if plan.name == "abort" else 30
    lines = abort_figures(args, plan, gpu_model) if plan.name == "abort" else kill_figures(args, plan, gpu_model)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
