"""Local-mode end-to-end harness: real runtime, real agent, real torchrun and trainer processes.

``run_job`` writes a manifest for the e2e recorder program (``tests/workers/recorder.py``), runs it with the local
runtime in this process (so a test can act between ticks through ``on_tick``) and returns the run: summary,
events, the per-step records of every process, and the state directory.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import json
import pathlib
import tempfile
import urllib.request
from collections.abc import Callable
from typing import Any, Optional

import yaml

from disttrain.api import validation
from disttrain.operator.local import chaos as chaos_mod
from disttrain.operator.local import forkserver
from disttrain.operator.local.runtime import LocalRuntime, RunOptions, Snapshot
from disttrain.operator.local.statedir import StateDir
from disttrain.operator.local.summary import Summary
from tests.conftest import REPO_ROOT, JobBuilder

RECORDER = "tests/workers/recorder.py"


@functools.cache
def _session_fork_servers() -> forkserver.ForkServers:
    """Fork servers kept for the whole test process: its jobs run the same agent and recorder programs, and a run's
    own servers would import torch twice per job. The recorder reads its ``E2E_*`` settings at run time, and pytest
    names the current test in ``PYTEST_CURRENT_TEST``. A server ends with this process (its stdin closes)."""
    logs = pathlib.Path(tempfile.mkdtemp(prefix="disttrain-e2e-fork-servers-"))
    servers = forkserver.ForkServers(logs, run_time=("E2E_", "PYTEST_CURRENT_TEST"))
    atexit.register(servers.close)
    return servers


def shared_fork_servers() -> Optional[forkserver.ForkServers]:
    """The session's fork servers, or None where ``DISTTRAIN_LOCAL_FORK=0`` is set now (a run's pods start cold)."""
    return _session_fork_servers() if forkserver.enabled() else None


def e2e_job(
    name: str,
    out: pathlib.Path,
    *,
    replicas: int = 2,
    max_steps: int = 24,
    dataset: int = 288,
    step_sleep: float = 0.0,
    extra_env: Optional[dict[str, str]] = None,
) -> JobBuilder:
    """A lean job: 12 samples per step, checkpoints every 5 steps, 1 process per node, fast local timings."""
    env = [
        {"name": "E2E_OUT", "value": str(out)},
        {"name": "E2E_DATASET", "value": str(dataset)},
        {"name": "E2E_STEP_SLEEP", "value": str(step_sleep)},
    ]
    env += [{"name": k, "value": v} for k, v in (extra_env or {}).items()]
    return (
        JobBuilder(name)
        .nodes(1, 3, replicas)
        .set(
            "spec.template.spec.containers",
            [{"name": "trainer", "image": "local", "command": ["python", "-u", RECORDER], "env": env}],
        )
        .set(
            "spec.training",
            {"globalBatchSize": 12, "microBatchSize": 2, "lr": {"base": 0.05}, "maxSteps": max_steps, "seed": 3},
        )
        .set("spec.checkpoint", {"claimName": "local", "path": "/ckpt", "intervalSteps": 5, "keep": 3})
        .set(
            "spec.rendezvous",
            {
                "joinTimeoutSeconds": 120,
                "lastCallTimeoutSeconds": 30,
                "keepAliveIntervalSeconds": 1,
                "keepAliveMaxAttempts": 3,
            },
        )
        .set(
            "spec.elastic",
            {
                "scaleDebounceSeconds": 0,
                "replacementWaitSeconds": 5,
                "drainTimeoutSeconds": 60,
                "collectiveTimeoutSeconds": 20,
            },
        )
        .set("spec.restartPolicy", {"backoffSeconds": 0})
        # On a real API server the tests wait for the relayed step: report it every 10 s, not every minute.
        .set("spec.reporting", {"progressIntervalSeconds": 10})
    )


@dataclasses.dataclass
class Run:
    summary: Summary
    runtime: LocalRuntime
    state: StateDir
    out: pathlib.Path

    @property
    def events(self) -> list[dict[str, Any]]:
        return self.state.read_events()

    def reasons(self) -> list[str]:
        return [e["reason"] for e in self.events]

    def records(self) -> list[dict[str, Any]]:
        found = []
        for path in sorted(self.out.glob("*.jsonl")):
            for line in path.read_text().splitlines():
                if line.strip():
                    found.append(dict(json.loads(line), process=path.stem))
        return found

    def executions(self) -> dict[int, list[list[dict[str, Any]]]]:
        """step -> the executions of that step; each execution is the records of one group (one per rank)."""
        by_group: dict[tuple[Any, ...], list[dict[str, Any]]] = collections.defaultdict(list)
        for record in self.records():
            by_group[(record["step"], record["group"])].append(record)
        steps: dict[int, list[list[dict[str, Any]]]] = collections.defaultdict(list)
        for (step, _group), records in sorted(by_group.items(), key=lambda kv: min(r["time"] for r in kv[1])):
            steps[step].append(sorted(records, key=lambda r: r["rank"]))
        return dict(steps)

    def final_trajectory(self) -> dict[int, list[dict[str, Any]]]:
        """step -> the records of the execution that counted (the last one)."""
        return {step: runs[-1] for step, runs in sorted(self.executions().items())}


def run_job(
    tmp_path: pathlib.Path,
    builder: JobBuilder,
    *,
    chaos: str = "",
    on_tick: Optional[Callable[[LocalRuntime, Snapshot], None]] = None,
    timeout_s: float = 150,
    not_ready_delay_s: float = 0.0,
    pulse_key: Optional[bytes] = None,
) -> Run:
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(builder.build()))
    job = validation.load_job(manifest)
    state = StateDir(tmp_path / "state")
    out = pathlib.Path(builder.obj["spec"]["template"]["spec"]["containers"][0]["env"][0]["value"])
    holder: dict[str, LocalRuntime] = {}

    def tick(snapshot: Snapshot) -> None:
        if on_tick is not None:
            on_tick(holder["runtime"], snapshot)

    options = RunOptions(
        chaos=chaos_mod.parse_chaos(chaos),
        workdir=str(REPO_ROOT),
        on_tick=tick,
        not_ready_delay_s=not_ready_delay_s,
        forks=shared_fork_servers(),
        pulse_key=pulse_key,
    )
    runtime = LocalRuntime(job, state, options)
    holder["runtime"] = runtime
    summary = runtime.run(timeout_s=timeout_s)
    return Run(summary, runtime, state, out)


def scrape(url: str) -> dict[str, float]:
    """A metrics endpoint as {'name{label="v",...}': value} (labels sorted)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=5).read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values
