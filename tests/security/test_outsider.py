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

import asyncio
import collections
import dataclasses
import itertools
import json
import os
import pathlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Optional

import pytest

from disttrain.api import constants
from disttrain.operator import access, pods, pulses
from disttrain.operator.agentbeat import AgentBeats
from disttrain.operator.local.runtime import LocalRuntime, Snapshot
from disttrain.operator.observed import PodView
from disttrain.trainer.agent.pulse import MAX_PENDING
from tests.conftest import REPO_ROOT, JobBuilder
from tests.e2e.conftest import Run, e2e_job, run_job
from tests.security import agentmemory, sniffed

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
CONNECT_OVERRUN_S = 12.0
"""How long a TCPStore client's connection attempt that the front refuses may go on, deaf to SIGTERM (torch's client
waits 5 s, then retries once after about 5.5 s)."""


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


def _steps_recorded(records: pathlib.Path) -> int:
    """The most steps any rank has recorded so far (the e2e recorder writes a line per step as it ends): what starts
    the attack, at once, where the job's status relays the step a few seconds late on a loaded machine."""
    counts = [path.read_bytes().count(b"\n") for path in records.glob("*.jsonl")] if records.is_dir() else []
    return max(counts, default=0)


@dataclasses.dataclass
class Strike:
    """What an attacked run has beside the plain 2-node job and the outsider's attack of its store port."""

    builder: Optional[JobBuilder] = None
    """The job (None: the 2-node recorder job of ``MAX_STEPS`` steps)."""
    sniff: Optional[Callable[[LocalRuntime], dict[str, Any]]] = None
    """What the outsider saw on the network, read as the attack begins (``--sniffed``)."""
    on_tick: Optional[Callable[[LocalRuntime, Snapshot, bool], None]] = None
    """Called on every tick, with whether the attack has begun (a scale request, the operator's pulse link)."""
    pulse_key: Optional[bytes] = None
    """The operator's own pulse key: the agent pulses (``RunOptions.pulse_key``)."""
    outsider_args: tuple[str, ...] = ()
    """More arguments of the outsider."""
    watch_s: float = 0.0
    """How much longer than its attacks the outsider may go on (its holders), the agent's memory watched."""


def _attacked_run(
    tmp_path: pathlib.Path,
    attack: str,
    *,
    seconds: float,
    step_sleep: float = STEP_SLEEP,
    watch_memory: bool = False,
    strike: Optional[Strike] = None,
) -> Attacked:
    """Run the job; once a rank has recorded step ``ATTACK_AT_STEP``, the outsider (started and ready before the
    job) attacks the agent's store port."""
    strike = strike or Strike()
    phases = len([name for name in attack.split(",") if name not in ("pulse", "idle")])
    """The attacks of ``seconds`` the outsider runs one after the other (the holders run alongside)."""
    marker = tmp_path / "marker"
    report_path = tmp_path / "outsider.json"
    log_path = tmp_path / "outsider.log"
    go_file = tmp_path / "outsider.go"
    sniffed_path = tmp_path / "sniffed.json"
    state: dict[str, Any] = {"proc": None, "start": 0.0, "peak": 0, "before": 0, "stop": threading.Event()}

    def watch(runtime: LocalRuntime) -> None:
        """The agent's peak while the attack lasts, until the outsider ends (its high-water mark reset as it begins,
        so the agent's start-up peak does not count; after the attack, the job's own growth does not either)."""
        until = time.monotonic() + seconds * phases + strike.watch_s + 2.0
        while not state["stop"].is_set() and time.monotonic() < until and state["proc"].poll() is None:
            pids = agentmemory.agent_pids(runtime)
            if not state["before"]:
                agentmemory.reset_peaks(pids)
            rss, hwm = agentmemory.rss_of(pids)
            state["before"] = state["before"] or rss
            state["peak"] = max(state["peak"], rss, hwm)
            proc = state["proc"]
            if state["peak"] > RUNAWAY_RSS and proc is not None and proc.poll() is None:
                proc.kill()  # the agent would have been OOM-killed long ago; spare this machine
            state["stop"].wait(0.2)

    def on_tick(runtime: LocalRuntime, snapshot: Snapshot) -> None:
        if strike.on_tick is not None:
            strike.on_tick(runtime, snapshot, bool(state["start"]))
        if state["start"] or _steps_recorded(tmp_path / "records") < ATTACK_AT_STEP:
            return
        state["start"] = time.time()
        if strike.sniff is not None:
            sniffed_path.write_text(json.dumps(strike.sniff(runtime)))
        ready = go_file.with_suffix(".tmp")
        ready.write_text(f"127.0.0.1:{runtime.store_port}")
        ready.rename(go_file)  # the outsider reads the whole address or nothing
        if watch_memory:
            threading.Thread(target=watch, args=(runtime,), daemon=True).start()

    # started before the job and waiting with torch imported: its start-up neither loads the machine while the job
    # starts nor delays the attack; it attacks the agent named in the go file
    argv = [sys.executable, str(OUTSIDER), "-", attack, "--seconds", str(seconds), "--marker", str(marker)]
    argv += ["--report", str(report_path), "--go-file", str(go_file)]
    if strike.sniff is not None:
        argv += ["--sniffed", str(sniffed_path)]
    argv += strike.outsider_args
    with log_path.open("wb") as log:  # the child holds its own copy
        state["proc"] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    ready_by = time.monotonic() + 120
    while not pathlib.Path(f"{go_file}.ready").exists() and state["proc"].poll() is None:
        assert time.monotonic() < ready_by, "the outsider did not import torch within 120 s"
        time.sleep(0.1)
    builder = strike.builder or e2e_job(
        f"outsider-{attack.replace(',', '-')}",
        tmp_path / "records",
        replicas=2,
        max_steps=MAX_STEPS,
        dataset=DATASET,
        step_sleep=step_sleep,
    )
    try:
        run = run_job(tmp_path, builder, on_tick=on_tick, timeout_s=240, pulse_key=strike.pulse_key)
    finally:
        proc: Optional[subprocess.Popen[bytes]] = state["proc"]
        if proc is not None:
            if not state["start"]:
                proc.terminate()  # the job ended before the attack step
            try:
                # the last attacks may be cut short: what they cost was measured while the job ran
                until = (state["start"] or time.time()) + seconds + strike.watch_s + 15
                proc.wait(timeout=max(5.0, until - time.time()))
            except subprocess.TimeoutExpired:
                proc.terminate()  # it still writes its report, once a refused connection attempt has ended
                try:
                    proc.wait(timeout=CONNECT_OVERRUN_S + 5)
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
    results: list[dict[str, Any]], attack: str, attacked: Attacked, baseline: Optional[Run], extra_sleep: float = 0.0
) -> None:
    """Measure what ``attack`` cost against ``baseline`` (``extra_sleep``: how much longer each attacked step
    sleeps; None: a job of its own, no delay is measured) and keep it for the session's summary; before any
    assertion, so a failed run is measured too."""
    summary, report = attacked.run.summary, attacked.report
    executions = attacked.run.executions()
    done = sorted(executions) == list(range(1, MAX_STEPS + 1))
    nan = float("nan")
    wall = summary.wall_seconds - baseline.summary.wall_seconds - MAX_STEPS * extra_sleep if baseline else nan
    training = (
        _training_after_attack(attacked.run)
        - _training_after_attack(baseline)
        - (MAX_STEPS - ATTACK_AT_STEP) * extra_sleep
        if done and baseline
        else nan
    )
    gap = _longest_gap(attacked.run, attacked.attack_start, attacked.attack_end)
    base_gap = _longest_gap(baseline) + extra_sleep if baseline else nan
    ops = sum(report.get("ops", {}).values())
    attempts = ops + sum(report.get("errors", {}).values())  # a TCPStore client's refused connections are errors
    warnings = collections.Counter(e["reason"] for e in attacked.run.events if e["type"] == "Warning")
    cost = (
        f"training after the attack began {training:+5.1f} s, job wall {wall:+5.1f} s against the unattacked run; "
        f"longest step gap {gap:.2f} s (unattacked {base_gap:.2f} s)"
        if baseline
        else f"job wall {summary.wall_seconds:.1f} s; longest step gap during the attack {gap:.2f} s"
    )
    line = (
        f"{attack:>6}: {cost}; {attempts} attempts, "
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
            "baseline_wall_s": baseline.summary.wall_seconds if baseline else None,
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
    # a rare connect that timed out while the front sheds the flood is the stranger's loss, not the job's
    assert ops.get("held", 0) >= 990, f"the outsider could not open its 1,000 idle connections: {ops}"
    for name in ("queue", "pipelined-get", "half-sent", "key-names", "append"):
        assert ops.get(name, 0) > 0 and ops.get(f"{name}-closed") == ops.get(name), f"{name}: {ops}"
    assert ops.get("held_at_end") == 0, f"idle connections of the stranger outlived the handshake limit: {ops}"
    growth = attacked.peak_agent_rss - attacked.agent_rss_before
    assert growth <= 64 * MIB, f"the agent grew by {growth / MIB:.0f} MiB under the raw abuse (allowed: 64 MiB)"
    agent_log = attacked.run.state.log_file("outsider-raw-agent").read_text(errors="replace")
    assert agent_log.count("serving the store") == 1, "the agent was restarted under the abuse"
    _assert_unharmed(attacked)


REFORM_STEPS = 80
REFORM_PHASE_SECONDS = 4.0
"""Each of the reform attack's two phases: the replay while the reform is in flight, then the beacons."""
REFORM_DATASET = 12 * REFORM_STEPS
PULSE_JOB = ("default", "outsider-reform")
"""The job as the operator's pulse rule keys it."""


class OperatorLink(threading.Thread):
    """The operator's end of the agent's pulse, as on a cluster: its links (operator/pulses.py) proving the job's
    pulse key, and its rule (operator/agentbeat.py) judging the agent every 0.1 s as its adapter does. While
    ``judging`` is set, every silence verdict is kept; ``breaks`` requests close the link and link again (a reset on
    the way, the operator's restart)."""

    def __init__(self, runtime_of: Callable[[], Optional[LocalRuntime]], operator_key: bytes) -> None:
        super().__init__(name="operator-link", daemon=True)
        self.runtime_of = runtime_of
        self.operator_key = operator_key
        self.judging = threading.Event()
        self.stop_event = threading.Event()
        self.break_requests: list[float] = []
        self.breaks: list[float] = []
        """When each break was made (monotonic)."""
        self.pulses: list[float] = []
        """When each pulse came (monotonic)."""
        self.verdicts: list[str] = []
        self.judge_until = float("inf")

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        link = self

        class Heard(AgentBeats):
            def pulsed(self, key: Any, uid: str, now: float) -> None:
                link.pulses.append(now)
                super().pulsed(key, uid, now)

        beats = Heard()
        links = pulses.PulseLinks(beats, self.operator_key)
        followed = ""
        try:
            while not self.stop_event.is_set():
                await asyncio.sleep(0.1)
                runtime = self.runtime_of()
                agent = runtime.agent if runtime is not None else None
                if runtime is None or agent is None:
                    continue
                pod = {
                    "metadata": {"uid": agent.uid, "labels": {access.LABEL_JOB_UID: runtime.obj["metadata"]["uid"]}},
                    "spec": {
                        "containers": [
                            {"ports": [{"name": constants.AGENT_PULSE_PORT_NAME, "containerPort": runtime.pulse_port}]}
                        ]
                    },
                    "status": {"phase": "Running", "podIP": "127.0.0.1"},
                }
                if followed != agent.uid:
                    links.follow(PULSE_JOB, pod)
                    followed = agent.uid
                if self.break_requests and time.monotonic() >= self.break_requests[0]:
                    self.break_requests.pop(0)
                    links.forget(agent.uid)
                    self.breaks.append(time.monotonic())
                    await asyncio.sleep(0.1)
                    links.follow(PULSE_JOB, pod)
                now = time.monotonic()
                beats.checked(now)
                why = beats.silence(PULSE_JOB, PodView(name=agent.name, uid=agent.uid), now)
                if self.judging.is_set() and now > self.judge_until:
                    self.judging.clear()
                if why and self.judging.is_set():
                    last = max(self.pulses, default=0.0)
                    self.verdicts.append(f"{why} at {now:.2f} (the last pulse {now - last:.2f} s before)")
        finally:
            await links.close()


@pytest.mark.timeout(300)
def test_replayed_directives_garbled_beacons_and_held_ports_during_reforms_cost_nothing(tmp_path, security_results):
    """A 3-node job with a tight stall rule (``stallMinSeconds: 3``) whose agent pulses to an operator's link. As
    the attack begins the job is scaled to 2 nodes, and back to 3 as soon as that drain is issued (two reforms,
    never charged; a new worker joins). The outsider knows what a stranger watching the network sees (the directive
    and the beacons as they went by, signed but not encrypted, and the pulse port): it replays the old directive
    while the reform is in flight, then garbles, deletes and replays the step beacons; all the while, and until the
    new worker has joined, it keeps up to 1,000 connections to the store port and 128 to the pulse port open,
    opening 100 a second of each in place of those closed, while the operator's link breaks twice. Asserted:
    nothing passed the front, the job went from 3 nodes to 2 and back to 3 and Succeeded with every step and every
    sample once, no restart charged, no node named stalled or lost, the agent never replaced, always pulsed (linked
    again after each break), and its memory grew by at most 64 MiB."""
    runtime_box: dict[str, LocalRuntime] = {}
    link = OperatorLink(lambda: runtime_box.get("runtime"), os.urandom(32))
    scaled: list[int] = []
    joined = tmp_path / "outsider.joined"
    """Written once the new worker has joined: the outsider's holders stop then."""

    def on_tick(runtime: LocalRuntime, snapshot: Snapshot, attacked: bool) -> None:
        runtime_box.setdefault("runtime", runtime)
        if snapshot.status.get("phase") in ("Succeeded", "Failed"):
            link.judging.clear()  # the agent's end is the job's, not a silence
        if not attacked:
            return
        if not scaled:
            scaled.append(2)
            runtime.set_replicas(2, "test: scale-down while the outsider replays the old directive")
            now = time.monotonic()
            link.judging.set()
            link.break_requests.extend([now + 1.5, now + 1.5 + REFORM_PHASE_SECONDS])
        elif scaled == [2] and (snapshot.status.get("control") or {}).get("action") == "drain":
            scaled.append(3)
            runtime.set_replicas(3, "test: scale back up while the outsider holds the ports")
        elif scaled == [2, 3] and not joined.exists():
            up = [e["time"] for e in runtime.events if e["reason"] == "ScaledUp"]
            back = [e for e in runtime.events if e["reason"] == "RendezvousComplete" and "3 nodes" in e["message"]]
            if up and any(e["time"] >= up[0] for e in back):
                joined.write_text("the new worker joined")
                link.judge_until = time.monotonic() + 1.0

    builder = e2e_job(
        "outsider-reform",
        tmp_path / "records",
        replicas=3,
        max_steps=REFORM_STEPS,
        dataset=REFORM_DATASET,
        step_sleep=STEP_SLEEP,
    ).set("spec.elastic.stallMinSeconds", 3)
    strike = Strike(
        builder=builder,
        sniff=lambda runtime: sniffed.sniff(runtime, 3),
        on_tick=on_tick,
        pulse_key=link.operator_key,
        outsider_args=("--hold", "1000", "--hold-until", str(joined)),
        watch_s=60.0,
    )

    link.start()
    try:
        attacked = _attacked_run(
            tmp_path, "replay,beacons,pulse,idle", seconds=REFORM_PHASE_SECONDS, watch_memory=True, strike=strike
        )
    finally:
        link.judging.clear()
        link.stop_event.set()
        link.join(timeout=10)
    _record(security_results, "reform", attacked, None)
    run, report = attacked.run, attacked.report
    ops = report.get("ops", {})
    assert report, f"the outsider wrote no report; its output: {attacked.outsider_log[-3000:]}"
    seen = json.loads((tmp_path / "sniffed.json").read_text())["values"]
    assert any("beacon" in key for key in seen) and any("signal" in key for key in seen), seen.keys()
    for name in ("replay-raw", "beacons-raw"):
        assert ops.get(name, 0) > 0 and ops.get(f"{name}-closed") == ops.get(name), f"{name}: {ops}"
    assert ops.get("pulse-most-held", 0) >= MAX_PENDING, f"the outsider did not hold the pulse port: {ops}"
    assert ops.get("idle-most-held", 0) >= 100, f"the outsider did not hold the store port: {ops}"
    assert joined.exists(), f"the new worker never joined; events {run.reasons()}"
    idle = next(phase for phase in report["phases"] if phase["attack"] == "idle")
    rejoined = max(e["time"] for e in run.events if e["reason"] == "RendezvousComplete")
    assert idle["end"] >= rejoined, "the outsider stopped holding the store port before the new worker joined"
    assert report["keys_seen"] == [] and not ops.get("connect"), f"the outsider got past the front: {ops}"

    assert run.summary.succeeded, f"phase {run.summary.phase}: {run.summary.message}; events {run.reasons()}"
    restarts = run.runtime.obj["status"].get("restarts") or {}
    assert not run.summary.restarts_by_reason and not restarts.get("total"), f"restarts charged: {restarts}"
    reasons = collections.Counter(run.reasons())
    harmful = {r: n for r, n in reasons.items() if r in ("NodeLost", "StepStalled", "RestartBudgetExhausted")}
    assert not harmful, f"a healthy node was named lost or stalled: {harmful}; events {run.reasons()}"
    assert reasons["ScaledDown"] == 1 and reasons["ScaledUp"] == 1, f"the scale requests' reforms: {run.reasons()}"
    assert not run.runtime.obj["status"].get("stalledNodes"), run.runtime.obj["status"].get("stalledNodes")
    agent_log = run.state.log_file("outsider-reform-agent").read_text(errors="replace")
    assert agent_log.count("serving the store") == 1, "the agent was replaced"

    trajectory = run.final_trajectory()
    assert sorted(trajectory) == list(range(1, REFORM_STEPS + 1)), f"steps skipped or extra: {sorted(trajectory)}"
    worlds = [records[0]["world"] for _, records in sorted(trajectory.items())]
    changes = [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]
    assert changes == [3, 2, 3], f"two reforms, 3 nodes to 2 and back (world size per step: {worlds})"
    assert all(len(records) == records[0]["world"] for records in trajectory.values()), "a step lacks a rank"
    consumed = collections.Counter(i for records in trajectory.values() for r in records for i in r["indices"])
    assert sorted(consumed) == list(range(REFORM_DATASET)) and set(consumed.values()) == {1}, "samples lost or twice"
    assert max(_step_times(run).values()) > attacked.attack_end, "the job was over before the attack: train longer"

    assert len(link.breaks) == 2, f"the operator's link was broken {len(link.breaks)} times, not 2"
    assert all(any(p > b for p in link.pulses) for b in link.breaks), "no pulse after a break: not linked again"
    gaps = sorted(round(b - a, 2) for a, b in itertools.pairwise(link.pulses))[-3:]
    assert link.verdicts == [], f"the operator judged the agent silent: {link.verdicts[:3]}; longest gaps {gaps}"
    growth = attacked.peak_agent_rss - attacked.agent_rss_before
    assert growth <= 64 * MIB, f"the agent grew by {growth / MIB:.0f} MiB under the attack (allowed: 64 MiB)"
