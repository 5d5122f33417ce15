"""Shared by the local-mode benchmarks: a lean job for the e2e recorder program and an in-process runner.

The runner drives the real local runtime (reconcile, job agent, torchrun, trainer) and lets the benchmark act
between ticks. Records of every step (time, step, group, load time) come from ``tests/workers/recorder.py``.
"""

from __future__ import annotations

import collections
import copy
import json
import pathlib
import sys
import tempfile
from collections.abc import Callable
from typing import Any, Optional

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from disttrain.api import constants  # noqa: E402
from disttrain.api.spec import DistTrainJob  # noqa: E402
from disttrain.operator.local.chaos import parse_chaos  # noqa: E402
from disttrain.operator.local.runtime import LocalRuntime, RunOptions, Snapshot  # noqa: E402
from disttrain.operator.local.statedir import StateDir  # noqa: E402


def use_registered_backend() -> str:
    """The rendezvous backend the nodes will use (the runtime falls back to c10d without our handler)."""
    from disttrain.operator.local.runtime import rendezvous_fallback

    return rendezvous_fallback() or constants.RDZV_BACKEND


def local_job(name: str, container: dict[str, Any], **sections: Any) -> dict[str, Any]:
    """A DistTrainJob for local mode that runs ``container`` on every node, with the benchmarks' common settings:
    heartbeats every second, checkpoints on the ``local`` claim, quick replacements, no restart backoff. Each of
    ``sections`` (``nodes``, ``training``, ``elastic``, ...) updates the spec's section of that name."""
    spec: dict[str, Any] = {
        "nodes": {"min": 1, "max": 4, "replicas": 1},
        "nprocPerNode": 1,
        "template": {"spec": {"containers": [container]}},
        "rendezvous": {
            "joinTimeoutSeconds": 120,
            "lastCallTimeoutSeconds": 30,
            "keepAliveIntervalSeconds": 1,
            "keepAliveMaxAttempts": 3,
        },
        "checkpoint": {"claimName": "local", "path": "/ckpt", "intervalSteps": 5, "keep": 3},
        "elastic": {
            "scaleDebounceSeconds": 0,
            "replacementWaitSeconds": 5,
            "drainTimeoutSeconds": 60,
            "collectiveTimeoutSeconds": 20,
        },
        "restartPolicy": {"backoffSeconds": 0, "maxRestarts": 100},
    }
    for section, value in sections.items():
        spec[section] = {**spec[section], **value} if isinstance(spec.get(section), dict) else value
    return {"apiVersion": "disttrain.dev/v1alpha1", "kind": "DistTrainJob", "metadata": {"name": name}, "spec": spec}


def recorder_job(
    name: str,
    out: pathlib.Path,
    *,
    replicas: int,
    max_steps: int,
    step_sleep: float = 0.0,
    global_batch: int = 12,
    interval: int = 5,
    dataset: Optional[int] = None,
) -> dict[str, Any]:
    env = [
        {"name": "E2E_OUT", "value": str(out)},
        {"name": "E2E_DATASET", "value": str(dataset or global_batch * max_steps)},
        {"name": "E2E_STEP_SLEEP", "value": str(step_sleep)},
    ]
    container = {
        "name": "trainer",
        "image": "local",
        "env": env,
        "command": ["python", "-u", "tests/workers/recorder.py"],
    }
    return local_job(
        name,
        container,
        nodes={"replicas": replicas},
        training={
            "globalBatchSize": global_batch,
            "microBatchSize": 1,
            "lr": {"base": 0.05},
            "maxSteps": max_steps,
            "seed": 3,
        },
        checkpoint={"intervalSteps": interval},
    )


def tinylm_job(name: str, *, replicas: int, max_steps: int) -> dict[str, Any]:
    import yaml

    obj = yaml.safe_load((REPO / "examples" / "jobs" / "demo.yaml").read_text())
    obj = copy.deepcopy(obj)
    obj["metadata"]["name"] = name
    obj["spec"]["nodes"]["replicas"] = replicas
    obj["spec"]["training"]["maxSteps"] = max_steps
    obj["spec"]["restartPolicy"]["maxRestarts"] = 100
    return obj


def run(
    obj: dict[str, Any],
    state_dir: pathlib.Path,
    *,
    chaos: str = "",
    on_tick: Optional[Callable[[LocalRuntime, Snapshot], None]] = None,
    timeout_s: float = 600,
    not_ready_delay_s: float = 0.0,
    gpus: Any = None,
    pulse_key: Optional[bytes] = None,
) -> LocalRuntime:
    """Run ``obj`` to its end in local mode; ``gpus``: a :class:`~disttrain.operator.local.gpuslices.GpuSlices` to
    split between the nodes (None: their environment is left as it is); ``pulse_key``: the agent pulses as on a
    cluster (``RunOptions.pulse_key``)."""
    job = DistTrainJob.model_validate(obj)
    holder: dict[str, LocalRuntime] = {}

    def tick(snapshot: Snapshot) -> None:
        if on_tick is not None:
            on_tick(holder["runtime"], snapshot)

    options = RunOptions(
        chaos=parse_chaos(chaos),
        workdir=str(REPO),
        on_tick=tick,
        not_ready_delay_s=not_ready_delay_s,
        gpus=gpus,
        pulse_key=pulse_key,
    )
    runtime = LocalRuntime(job, StateDir(state_dir), options)
    holder["runtime"] = runtime
    runtime.summary = runtime.run(timeout_s=timeout_s)
    return runtime


def records(out: pathlib.Path) -> list[dict[str, Any]]:
    found = []
    for path in sorted(out.glob("*.jsonl")):
        found += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(found, key=lambda r: r["time"])


def lost_steps(found: list[dict[str, Any]]) -> int:
    """Optimizer steps executed more than once (by different groups): work redone after a resume."""
    groups_per_step: dict[int, set[str]] = collections.defaultdict(set)
    for record in found:
        groups_per_step[record["step"]].add(record["group"])
    return sum(len(groups) - 1 for groups in groups_per_step.values())


def workdir(prefix: str) -> pathlib.Path:
    return pathlib.Path(tempfile.mkdtemp(prefix=f"disttrain-bench-{prefix}-"))
