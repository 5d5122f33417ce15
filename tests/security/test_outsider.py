"""An outsider without the job's secret attacks a real local job (agent + 2 nodes, torchrun, the e2e recorder)
through the agent's store port, and costs it nothing.

Each attack (``tests/security/outsider.py``) starts once the job trains and runs while it trains. A plain TCPStore
client tries to list the keys, forge every control key, plant a pickle as torchrun's rendezvous state and delete
every key: it never gets past the store front's handshake. Raw on the wire, the abuses that torch's server alone
could not bound (queues, pipelined reads, half-sent values, long key names, appends, 1,000 idle connections) are
closed at the front. For each: the marker file never appears (no code of the attacker ran), the job Succeeded, no
restart was charged, every step ran exactly once (none replayed, none skipped, every sample once), and the delay
is measured against an unattacked run of the same job in the same session. Under the raw abuse the agent's memory
grows by at most 64 MiB.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import json
import pathlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Optional

import pytest

from disttrain.operator import pods
from disttrain.operator.local import proctree
from disttrain.operator.local.runtime import LocalRuntime, Snapshot
from tests.conftest import REPO_ROOT
from tests.e2e.conftest import Run, e2e_job, run_job

pytestmark = [pytest.mark.security, pytest.mark.slow]

OUTSIDER = REPO_ROOT / "tests" / "security" / "outsider.py"
MAX_STEPS = 30
DATASET = 360  # 12 samples per step: one epoch in 30 steps
STEP_SLEEP = 0.25
ATTACK_AT_STEP = 3
ATTACK_SECONDS = 6.0
RAW_SECONDS = 15.0
RUNAWAY_RSS = 3 * 2**30
"""The test stops the flood when the agent passes this (a local agent has no memory limit to stop it)."""
MIB = 2**20


def _memory_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    return int(quantity[:-2]) * units[quantity[-2:]] if quantity[-2:] in units else int(quantity)


AGENT_MEMORY_LIMIT = _memory_bytes(pods.AGENT_MEMORY)
"""The memory bound asserted under the flood: the agent pod's own limit, not a number of this test's."""


def test_the_agent_limit_read_here_is_the_pods():
    """The limit parses to a plausible size (a unit this test does not know would read as bytes)."""
    assert 256 * MIB <= AGENT_MEMORY_LIMIT <= 8 * 2**30, pods.AGENT_MEMORY


@dataclasses.dataclass
class Attacked:
    """An attacked run: the job, the outsider's report, and what was measured while it ran."""

    run: Run
    report: dict[str, Any]
    marker: pathlib.Path
    attack_start: float
    attack_end: float
    peak_agent_rss: int
    agent_rss_before: int
    """The agent's RSS when the attack began (its own baseline: Python, torch)."""
    outsider_log: str


def _rss_of(pids: set[int]) -> tuple[int, int]:
    """(sum of VmRSS, largest VmHWM) of ``pids`` in bytes, from /proc (pids that are gone count 0)."""
    rss = hwm = 0
    for pid in pids:
        try:
            text = pathlib.Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("VmRSS:"):
                rss += int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = max(hwm, int(line.split()[1]) * 1024)
    return rss, hwm


def _agent_pids(runtime: LocalRuntime) -> set[int]:
    agent = runtime.agent
    if agent is None or not agent.is_alive:
        return set()
    return proctree.find_tree(agent.marker, agent.proc.pid)


def _steps_recorded(records: pathlib.Path) -> int:
    """The most steps any rank has recorded so far (the e2e recorder writes a line per step as it ends): what starts
    the attack, at once, where the job's status relays the step a few seconds late on a loaded machine."""
    counts = [path.read_bytes().count(b"\n") for path in records.glob("*.jsonl")] if records.is_dir() else []
    return max(counts, default=0)


def _attacked_run(
    tmp_path: pathlib.Path, attack: str, *, seconds: float, step_sleep: float = STEP_SLEEP, watch_memory: bool = False
) -> Attacked:
    """Run the job; once a rank has recorded step ``ATTACK_AT_STEP``, the outsider (started and ready before the
    job) attacks the agent's store port."""
    marker = tmp_path / "marker"
    report_path = tmp_path / "outsider.json"
    log_path = tmp_path / "outsider.log"
    go_file = tmp_path / "outsider.go"
    state: dict[str, Any] = {"proc": None, "start": 0.0, "peak": 0, "before": 0, "stop": threading.Event()}

    def watch(runtime: LocalRuntime) -> None:
        """The agent's peak while the attack lasts (its high-water mark reset as it begins, so the agent's start-up
        peak does not count; after the attack, the job's own growth does not either)."""
        until = time.monotonic() + seconds + 2.0
        while not state["stop"].is_set() and time.monotonic() < until:
            pids = _agent_pids(runtime)
            if not state["before"]:
                for pid in pids:
                    with contextlib.suppress(OSError):
                        pathlib.Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to VmRSS
            rss, hwm = _rss_of(pids)
            state["before"] = state["before"] or rss
            state["peak"] = max(state["peak"], rss, hwm)
            proc = state["proc"]
            if state["peak"] > RUNAWAY_RSS and proc is not None and proc.poll() is None:
                proc.kill()  # the agent would have been OOM-killed long ago; spare this machine
            state["stop"].wait(0.2)

    def on_tick(runtime: LocalRuntime, snapshot: Snapshot) -> None:
        if state["start"] or _steps_recorded(tmp_path / "records") < ATTACK_AT_STEP:
            return
        state["start"] = time.time()
        ready = go_file.with_suffix(".tmp")
        ready.write_text(f"127.0.0.1:{runtime.store_port}")
        ready.rename(go_file)  # the outsider reads the whole address or nothing
        if watch_memory:
            threading.Thread(target=watch, args=(runtime,), daemon=True).start()

    # started before the job and waiting with torch imported: its start-up neither loads the machine while the job
    # starts nor delays the attack; it attacks the agent named in the go file
    argv = [sys.executable, str(OUTSIDER), "-", attack, "--seconds", str(seconds), "--marker", str(marker)]
    argv += ["--report", str(report_path), "--go-file", str(go_file)]
    with log_path.open("wb") as log:  # the child holds its own copy
        state["proc"] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    ready_by = time.monotonic() + 120
    while not pathlib.Path(f"{go_file}.ready").exists() and state["proc"].poll() is None:
        assert time.monotonic() < ready_by, "the outsider did not import torch within 120 s"
        time.sleep(0.1)
    builder = e2e_job(
        f"outsider-{attack.replace(',', '-')}",
        tmp_path / "records",
        replicas=2,
        max_steps=MAX_STEPS,
        dataset=DATASET,
        step_sleep=step_sleep,
    )
    try:
        run = run_job(tmp_path, builder, on_tick=on_tick, timeout_s=240)
    finally:
        proc: Optional[subprocess.Popen[bytes]] = state["proc"]
        if proc is not None:
            if not state["start"]:
                proc.terminate()  # the job ended before the attack step
            try:
                proc.wait(timeout=max(5.0, (state["start"] or time.time()) + seconds + 15 - time.time()))
            except subprocess.TimeoutExpired:
                proc.terminate()  # it still writes its report
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        state["stop"].set()
    assert state["start"], f"the job never reached step {ATTACK_AT_STEP}: {run.reasons()}"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    end = report["started_at"] + report["seconds"] if report else time.time()
    return Attacked(
        run, report, marker, state["start"], end, state["peak"], state["before"], log_path.read_text(errors="replace")
    )


def _step_times(run: Run) -> dict[int, float]:
    """step -> when its last execution finished (the latest record of its ranks)."""
    return {step: max(r["time"] for r in records) for step, records in run.final_trajectory().items()}


def _longest_gap(run: Run, start: float = 0.0, end: float = float("inf")) -> float:
    """The longest time between two consecutive steps ending in [start, end + one step]."""
    times = sorted(_step_times(run).values())
    gaps = [b - a for a, b in itertools.pairwise(times) if b >= start and a <= end]
    return max(gaps, default=0.0)


def _assert_unharmed(attacked: Attacked) -> None:
    """No code ran, the job Succeeded, no restart was charged, every step ran once and every sample once."""
    run = attacked.run
    assert not attacked.marker.exists(), f"the attacker's pickle ran in the job: {attacked.marker} was created"
    assert run.summary.succeeded, f"phase {run.summary.phase}: {run.summary.message}; events {run.reasons()}"
    restarts = run.runtime.obj["status"].get("restarts") or {}
    lost = [
        f"{e['reason']} {e['time'] - attacked.attack_start:+.1f} s from the attack's start: {e['message'][:160]}"
        for e in run.events
        if e["reason"] in ("NodeLost", "Reforming", "RestartBudgetExhausted")
    ]
    assert not run.summary.restarts_by_reason and not restarts.get("total"), f"restarts charged: {restarts}; {lost}"
    executions = run.executions()
    assert sorted(executions) == list(range(1, MAX_STEPS + 1)), f"steps skipped or extra: {sorted(executions)}"
    replayed = {step: len(runs) for step, runs in executions.items() if len(runs) != 1}
    assert not replayed, f"steps replayed (step: executions): {replayed}"
    assert all(len(runs[0]) == 2 for runs in executions.values()), "a step ran without both ranks"
    consumed = collections.Counter(i for runs in executions.values() for r in runs[0] for i in r["indices"])
    assert sorted(consumed) == list(range(DATASET)) and set(consumed.values()) == {1}, "samples lost or repeated"
    assert run.summary.steps == MAX_STEPS, f"the job's status says step {run.summary.steps}, all {MAX_STEPS} ran"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """The same job, unattacked, once per module: what the attacked runs' delays are measured against."""
    tmp_path = tmp_path_factory.mktemp("baseline")
    run = run_job(
        tmp_path,
        e2e_job(
            "outsider-baseline",
            tmp_path / "records",
            replicas=2,
            max_steps=MAX_STEPS,
            dataset=DATASET,
            step_sleep=STEP_SLEEP,
        ),
        timeout_s=240,
    )
    assert run.summary.succeeded, run.reasons()
    yield run


def _training_after_attack(run: Run) -> float:
    """Seconds from the end of step ``ATTACK_AT_STEP`` (the attack starts about then) to the end of the last step:
    the part of the run an attack can slow down, without the start-up's noise on a loaded machine."""
    times = _step_times(run)
    return times[max(times)] - times[ATTACK_AT_STEP]


def _record(
    results: list[dict[str, Any]], attack: str, attacked: Attacked, baseline: Run, extra_sleep: float = 0.0
) -> None:
    """Measure what ``attack`` cost against ``baseline`` (``extra_sleep``: how much longer each attacked step
    sleeps) and keep it for the session's summary; before any assertion, so a failed run is measured too."""
    summary, report = attacked.run.summary, attacked.report
    executions = attacked.run.executions()
    done = sorted(executions) == list(range(1, MAX_STEPS + 1))
    wall = summary.wall_seconds - baseline.summary.wall_seconds - MAX_STEPS * extra_sleep
    training = (
        _training_after_attack(attacked.run)
        - _training_after_attack(baseline)
        - (MAX_STEPS - ATTACK_AT_STEP) * extra_sleep
        if done
        else float("nan")
    )
    gap = _longest_gap(attacked.run, attacked.attack_start, attacked.attack_end)
    base_gap = _longest_gap(baseline) + extra_sleep
    ops = sum(report.get("ops", {}).values())
    warnings = collections.Counter(e["reason"] for e in attacked.run.events if e["type"] == "Warning")
    line = (
        f"{attack:>6}: training after the attack began {training:+5.1f} s, job wall {wall:+5.1f} s against the "
        f"unattacked run; longest step gap {gap:.2f} s (unattacked {base_gap:.2f} s); {ops} store ops, "
        f"{report.get('bytes_sent', 0) / MIB:.0f} MiB sent, {len(report.get('keys_seen', []))} keys seen; "
        f"phase {summary.phase}, restarts {dict(summary.restarts_by_reason) or 0}, warnings {dict(warnings)}"
    )
    if attacked.peak_agent_rss:
        line += (
            f"; agent RSS {attacked.agent_rss_before / MIB:.0f} MiB before, peak {attacked.peak_agent_rss / MIB:.0f}"
            f" MiB (limit {AGENT_MEMORY_LIMIT / MIB:.0f})"
        )
    results.append(
        {
            "attack": attack,
            "line": line,
            "training_delay_s": round(training, 2),
            "wall_delay_s": round(wall, 2),
            "longest_gap_s": round(gap, 2),
            "baseline_longest_gap_s": round(base_gap, 2),
            "wall_s": summary.wall_seconds,
            "baseline_wall_s": baseline.summary.wall_seconds,
            "ops": ops,
            "bytes_sent": report.get("bytes_sent", 0),
            "peak_agent_rss": attacked.peak_agent_rss,
            "agent_rss_before": attacked.agent_rss_before,
            "phase": summary.phase,
            "restarts": dict(summary.restarts_by_reason),
            "warnings": dict(warnings),
        }
    )


def _nothing_got_through(report: dict[str, Any], log: str) -> None:
    """The outsider tried (else a pass would prove nothing) and never reached the store behind the front."""
    assert report, f"the outsider wrote no report; its output: {log[-3000:]}"
    assert sum(report["errors"].values()) > 0, f"the outsider made no attempt: {report}"
    assert report["keys_seen"] == [], f"the outsider listed keys through the front: {report['keys_seen'][:5]}"
    assert not report["ops"].get("connect"), f"a TCPStore client without the secret connected: {report['ops']}"


@pytest.mark.timeout(300)
def test_a_torch_client_without_the_secret_reaches_nothing_of_the_store(tmp_path, baseline, security_results):
    """The forge, pickle and delete attacks of a plain TCPStore client: not one of its requests reaches the store
    (its connection fails at the front's handshake), and the job does not notice."""
    attacked = _attacked_run(tmp_path, "list,forge,pickle,delete", seconds=ATTACK_SECONDS, watch_memory=True)
    _record(security_results, "client", attacked, baseline)
    _nothing_got_through(attacked.report, attacked.outsider_log)
    _assert_unharmed(attacked)


@pytest.mark.timeout(300)
def test_raw_abuse_of_the_store_port_is_refused_at_the_front_and_bounded(tmp_path, baseline, security_results):
    """The issue's table, raw on the wire without the secret: 1,000 idle connections held, 8 MiB queue entries,
    pipelined reads never read, 8 MiB values one byte short, 8191-byte key names, a 8 MiB append. The front closes
    each before a byte reaches torch's server; the agent's memory barely moves, and the job does not notice."""
    attacked = _attacked_run(tmp_path, "raw", seconds=RAW_SECONDS, watch_memory=True)
    _record(security_results, "raw", attacked, baseline)
    report, ops = attacked.report, attacked.report.get("ops", {})
    assert report, f"the outsider wrote no report; its output: {attacked.outsider_log[-3000:]}"
    assert ops.get("held") == 1000, f"the outsider could not open its 1,000 idle connections: {ops}"
    for name in ("queue", "pipelined-get", "half-sent", "key-names", "append"):
        assert ops.get(name, 0) > 0 and ops.get(f"{name}-closed") == ops.get(name), f"{name}: {ops}"
    assert ops.get("held_at_end") == 0, f"idle connections of the stranger outlived the handshake limit: {ops}"
    growth = attacked.peak_agent_rss - attacked.agent_rss_before
    assert growth <= 64 * MIB, f"the agent grew by {growth / MIB:.0f} MiB under the raw abuse (allowed: 64 MiB)"
    agent_log = attacked.run.state.log_file("outsider-raw-agent").read_text(errors="replace")
    assert agent_log.count("serving the store") == 1, "the agent was restarted under the abuse"
    _assert_unharmed(attacked)
