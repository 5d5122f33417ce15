"""``disttrain local run | scale | status``: the local-mode subcommands (wired into ``disttrain`` by
:mod:`disttrain.operator.cli`).

``run`` holds the runtime in the foreground; ``scale`` and ``status`` talk to it through the job's state
directory, so they work from another terminal. Heavy imports (rich, prometheus-client) stay inside functions.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import signal
import sys
from typing import TYPE_CHECKING, Optional

from disttrain.operator.local.gpuslices import GpuSlices
from disttrain.operator.local.statedir import StateDir

if TYPE_CHECKING:
    from disttrain.api.spec import DistTrainJob
    from disttrain.operator.local.chaos import ChaosEvent


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p_local = sub.add_parser("local", help="run a DistTrainJob on this machine (no cluster): run, scale, status")
    local = p_local.add_subparsers(dest="local_command", required=True, metavar="ACTION")

    p_run = local.add_parser("run", help="run JOB.yaml to the end with local processes as nodes")
    p_run.add_argument("file", metavar="JOB.yaml")
    p_run.add_argument("--nodes", type=int, help="initial node count (overrides spec.nodes.replicas)")
    p_run.add_argument("--chaos", default="", help='e.g. "kill-node@30s,add-node@60s,kill-agent@90s"')
    p_run.add_argument("--state-dir", help="state directory (default .disttrain/<job name>)")
    p_run.add_argument("--workdir", help="working directory of the nodes (default: the current directory)")
    p_run.add_argument("--metrics-port", type=int, default=0, help="operator metrics port (default: a free one)")
    p_run.add_argument("--timeout", type=float, help="stop (and fail) after this many seconds")
    p_run.add_argument(
        "--resume", action="store_true", help="keep the state directory's checkpoints and continue from the newest one"
    )
    p_run.add_argument("--plain", action="store_true", help="plain log lines instead of the live panel")
    p_run.add_argument(
        "--device",
        choices=("auto", "cpu"),
        default="auto",
        help="auto: as the manifest asks (a GPU request without CUDA here is refused); "
        "cpu: drop the trainer container's GPU request and train on the CPU",
    )
    p_run.set_defaults(func=cmd_run)

    p_scale = local.add_parser("scale", help="set the node count of a running local job")
    p_scale.add_argument("job", metavar="JOB", help="job name, its manifest, or its state directory")
    p_scale.add_argument("--replicas", type=int, required=True)
    p_scale.add_argument("--state-dir")
    p_scale.set_defaults(func=cmd_scale)

    p_status = local.add_parser("status", help="print the status of a local job (JSON with --json)")
    p_status.add_argument("job", metavar="JOB", help="job name, its manifest, or its state directory")
    p_status.add_argument("--state-dir")
    p_status.add_argument("--json", action="store_true")
    p_status.set_defaults(func=cmd_status)


def resolve_state(job: str, state_dir: Optional[str]) -> StateDir:
    """A job name, a manifest path or a state directory -> the job's state directory."""
    if state_dir:
        return StateDir.for_job(job, state_dir)
    path = pathlib.Path(job)
    if path.is_dir():
        candidate = StateDir(path.resolve())
        if candidate.job_file.exists():
            return candidate
    if path.is_file():
        from disttrain.api import constants, yamlload

        try:  # the bounded loader: a hostile file given as JOB costs no more than `disttrain validate` on it
            [document] = yamlload.load_file(path)
            name = document["metadata"]["name"]
            if not isinstance(name, str) or not re.fullmatch(constants.DNS_1035_LABEL, name):
                raise ValueError(name)  # a name like "../x" must not pick a state directory elsewhere
        except (yamlload.ManifestInputError, ValueError, LookupError, TypeError):  # fall back to the file's stem
            name = path.stem
        return StateDir.for_job(name)
    return StateDir.for_job(job)


def cmd_run(args: argparse.Namespace) -> int:
    from disttrain.api import validation
    from disttrain.operator.local import chaos as chaos_mod

    try:
        job = validation.load_job(pathlib.Path(args.file))
    except validation.ManifestError as error:
        print(f"{error}\nnothing was started.", file=sys.stderr)
        return 2
    try:
        chaos = chaos_mod.parse_chaos(args.chaos)
    except chaos_mod.ChaosSyntaxError as error:
        print(f"{error}\nnothing was started.", file=sys.stderr)
        return 2
    nodes = job.spec.nodes
    if args.nodes is not None:
        if not nodes.min <= args.nodes <= nodes.max:
            print(
                f"--nodes {args.nodes}: must be within spec.nodes.min={nodes.min} and spec.nodes.max={nodes.max}"
                "\nnothing was started.",
                file=sys.stderr,
            )
            return 2
        nodes.replicas = args.nodes
    refused, gpus = _check_device(job, args.device)
    if refused:
        print(f"{refused}\nnothing was started.", file=sys.stderr)
        return 2
    state = StateDir.for_job(job.metadata.name, args.state_dir)
    if state.is_running():
        print(f"a local run of {job.metadata.name} is already running with state in {state.path}", file=sys.stderr)
        return 1
    if state.path.exists() and not args.resume:
        shutil.rmtree(state.path)
    return _run(job, state, chaos, args, gpus)


def _check_device(job: DistTrainJob, device: str) -> tuple[Optional[str], Optional[GpuSlices]]:
    """Why ``job`` cannot run on this machine as asked (it requests GPUs and CUDA is not here, or the machine has
    too few GPUs for its nodes), or None; and the GPUs to split between its nodes (None: no GPU, or the job pins its
    own). ``--device cpu`` makes it a CPU job instead (:mod:`disttrain.operator.local.gpucheck`,
    :mod:`disttrain.operator.local.gpuslices`)."""
    from disttrain.api import contract as contract_mod
    from disttrain.operator.local import gpucheck, gpuslices

    if device == "cpu":
        dropped = gpucheck.train_on_cpu(job)
        if dropped:
            print(f"--device cpu: the trainer container's request of {dropped} GPU(s) is dropped; training on the CPU")
        return None, None
    requested = contract_mod.requested_gpus(job.spec.template)
    if gpuslices.pins_its_own_devices(job) or (requested == 0 and not gpucheck.machine_has_gpus()):
        return None, None
    facts = gpucheck.probe_torch()
    if isinstance(facts, str):
        print(f"note: could not ask torch about CUDA ({facts}); the trainer checks it itself", file=sys.stderr)
        return None, None
    refused = gpucheck.refusal(job, facts)
    if refused or not facts.available:
        return refused, None
    mask = os.environ.get(gpuslices.VISIBLE_DEVICES_ENV)
    devices = gpuslices.visible_devices(mask, facts.devices)
    per_node = gpuslices.gpus_per_node(job)
    short = gpuslices.shortage_message(devices, mask, job.spec.nodes.replicas, per_node)
    if short:
        return short, None
    print(f"GPUs: {len(devices)} visible ({','.join(devices)}), {per_node} per local node, each node its own")
    return None, gpuslices.GpuSlices(devices, per_node)


def _run(
    job: DistTrainJob,
    state: StateDir,
    chaos: list[ChaosEvent],
    args: argparse.Namespace,
    gpus: Optional[GpuSlices] = None,
) -> int:
    from rich.console import Console

    from disttrain.operator.local import display as display_mod
    from disttrain.operator.local.runtime import LocalRuntime, RunOptions

    console = Console()
    view = display_mod.Display(
        job.metadata.name, job.spec.training.max_steps, console, live=False if args.plain else None
    )
    options = RunOptions(
        chaos=chaos,
        workdir=args.workdir,
        metrics_port=args.metrics_port,
        on_tick=view.on_tick,
        on_event=view.on_event,
        gpus=gpus,
    )
    runtime = LocalRuntime(job, state, options)
    # SIGTERM/SIGHUP end the run like Ctrl-C: every node, the agent and their workers are killed, never orphaned.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupt)
    with view:
        summary = runtime.run(timeout_s=args.timeout)
    display_mod.render_summary(summary, console)
    console.print(f"state, logs and checkpoints: {state.path}", highlight=False)
    if runtime.interrupted:
        return 130
    return 0 if summary.succeeded else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def cmd_scale(args: argparse.Namespace) -> int:
    state = resolve_state(args.job, args.state_dir)
    if not state.is_running():
        print(
            f"no local run is going with state in {state.path} (start one with `disttrain local run`)", file=sys.stderr
        )
        return 1
    if args.replicas < 1:
        print(f"--replicas {args.replicas}: must be at least 1", file=sys.stderr)
        return 2
    job = state.read_json(state.job_file) or {}
    nodes = (job.get("spec") or {}).get("nodes") or {}
    if nodes and not nodes.get("min", 1) <= args.replicas <= nodes.get("max", args.replicas):
        print(
            f"note: {args.replicas} is outside spec.nodes [{nodes.get('min')}, {nodes.get('max')}]; it will be clamped",
            file=sys.stderr,
        )
    state.request_scale(args.replicas)
    print(f"{job.get('metadata', {}).get('name', args.job)}: scale to {args.replicas} nodes requested")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    state = resolve_state(args.job, args.state_dir)
    job = state.read_json(state.job_file)
    if job is None:
        print(f"no local job state in {state.path}", file=sys.stderr)
        return 1
    status = dict(job.get("status") or {})  # the runtime merges the agent's progress into it every tick
    running = state.is_running()
    if args.json:
        print(json.dumps({"running": running, "status": status}, indent=2, sort_keys=True))
        return 0
    ckpt = status.get("lastCheckpoint") or {}
    restarts = (status.get("restarts") or {}).get("byReason") or {}
    lines = [
        f"job:          {job['metadata']['name']} ({'running' if running else 'not running'}; state {state.path})",
        f"phase:        {status.get('phase', 'Pending')}: {status.get('message', '')}",
        f"step:         {status.get('step', 0)} ({status.get('samplesConsumed', 0)} samples)",
        f"world size:   {status.get('worldSize', 0)} ({status.get('replicas', 0)} pods, desired "
        f"{status.get('desiredNodes', 0)} nodes, spec.nodes.replicas {job['spec']['nodes']['replicas']})",
        f"checkpoint:   {'step ' + str(ckpt['step']) if ckpt else '-'}",
        f"reforms:      {status.get('reforms', 0)}",
        f"restarts:     {', '.join(f'{k} {v}' for k, v in restarts.items()) or '0'}",
    ]
    runtime = state.read_json(state.runtime_file) or {}
    if runtime.get("metricsUrl") and running:
        lines.append(f"metrics:      {runtime['metricsUrl']}")
    print("\n".join(lines))
    return 0
