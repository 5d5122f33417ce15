"""Keys written into a running local job's store by whoever reaches it are reported in one bounded summary, never
echoed as written, and never crowd out the job's own Warnings.

A stranger without the secret writes fresh keys with hostile names (control characters, a fake ``NodeLost``
line, 4,000 characters) through the agent's store port: the front closes each connection, nothing is counted. A
process of the agent's pod (any local process, in local mode) writes such keys straight to the loopback store
server, outside the job's namespace and inside it: the agent's guardian deletes and counts every one. Meanwhile a
node of the job dies. Asserted: the job Succeeds with the loss counted as one infrastructure loss and no restart
charged; its own node-loss Warning is there; one ``StoreValueRejected`` summary a minute at most, naming no key;
``status.storeRejections`` counts exactly the keys written past the front; no text of the writers appears as
written in any Event or in the status; the agent grows by at most 64 MiB and is never replaced.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import socket
import threading
import time
from typing import Any

import pytest

from disttrain.api import storeauth
from disttrain.operator.local.runtime import LocalRuntime, Snapshot
from tests.e2e.conftest import e2e_job, run_job
from tests.security import agentmemory, procnet
from tests.security.outsider import VALIDATE, _wire_set_value

pytestmark = [pytest.mark.security, pytest.mark.slow]

MIB = 2**20
STEPS = 32
START_AT_STEP = 3
FOREIGN_KEYS = 60
"""Keys outside the job's namespace written past the front, one every :data:`WRITE_EVERY_S`."""
NAMESPACE_KEYS = 12
"""Keys under the job's ``disttrain/`` written past the front (unsigned)."""
WRITE_EVERY_S = 0.05
INSIDE = "zqinsidezq"
OUTSIDE = "zqoutsidezq"
"""Tokens in every key the writers choose: whatever carries one was written by them."""
HOSTILE = "\x00\x1b[31m\r\nWarning NodeLost node-fake-{n}: the node was lost, the job failed\n\u202e"
"""What follows the token in each key: control characters, a fake Event line, a bidi override."""
LONG_KEY = 4000


def hostile_key(token: str, n: int) -> str:
    head = f"{token}-{n}" + HOSTILE.format(n=n)
    return head + "A" * (LONG_KEY - len(head))


@dataclasses.dataclass
class Writers:
    """The two writers' work, on a thread of the test: past the front (the agent's loopback server) and at it."""

    loopback_port: int
    store_port: int
    namespace: str
    written: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    front_closed: int = 0
    started: float = 0.0
    ended: float = 0.0

    def run(self) -> None:
        self.started = time.time()
        inside = socket.create_connection(("127.0.0.1", self.loopback_port), timeout=5)
        try:
            inside.sendall(VALIDATE)
            for n in range(FOREIGN_KEYS + NAMESPACE_KEYS):
                key = hostile_key(INSIDE, n)
                if n >= FOREIGN_KEYS:
                    key = self.namespace + "disttrain/" + key
                inside.sendall(_wire_set_value(key, b"forged"))
                self.written["namespace" if n >= FOREIGN_KEYS else "foreign"] += 1
                self._at_the_front(n)
                time.sleep(WRITE_EVERY_S)
        finally:
            inside.close()
            self.ended = time.time()

    def _at_the_front(self, n: int) -> None:
        """The same key, by a stranger without the secret, through the store port: the front closes it unproven."""
        try:
            with socket.create_connection(("127.0.0.1", self.store_port), timeout=5) as sock:
                sock.sendall(VALIDATE + _wire_set_value(hostile_key(OUTSIDE, n), b"forged"))
                sock.settimeout(5)
                while sock.recv(65536):
                    pass
            self.front_closed += 1
        except OSError:
            self.front_closed += 1  # reset by the front


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, list):
        return [s for item in value for s in _strings(item)]
    return []


def _printable(text: str) -> bool:
    return all(" " <= ch <= "~" for ch in text)


@pytest.mark.timeout(240)
def test_rejected_keys_are_summed_up_once_never_echoed_and_never_crowd_out_the_jobs_warnings(tmp_path):
    state: dict[str, Any] = {"writers": None, "thread": None, "peak": 0, "before": 0}
    stop = threading.Event()

    def watch(runtime: LocalRuntime) -> None:
        pids = agentmemory.agent_pids(runtime)
        agentmemory.reset_peaks(pids)
        state["before"] = agentmemory.rss_of(pids)[0]
        while not stop.wait(0.2):
            rss, hwm = agentmemory.rss_of(agentmemory.agent_pids(runtime))
            state["peak"] = max(state["peak"], rss, hwm)

    def on_tick(runtime: LocalRuntime, snapshot: Snapshot) -> None:
        if state["writers"] is not None or int(snapshot.status.get("step") or 0) < START_AT_STEP:
            return
        pids = agentmemory.agent_pids(runtime)
        ports = procnet.loopback_ports(pids, but={runtime.store_port, runtime.pulse_port})
        assert len(ports) == 1, f"the agent's loopback store server: {ports} (pids {pids})"
        namespace = storeauth.key_prefix(runtime.spawner.store_secret) + "/"
        writers = state["writers"] = Writers(ports.pop(), runtime.store_port, namespace)
        threading.Thread(target=watch, args=(runtime,), daemon=True).start()
        state["thread"] = threading.Thread(target=writers.run, daemon=True)
        state["thread"].start()

    builder = e2e_job(
        "rejections", tmp_path / "records", replicas=2, max_steps=STEPS, dataset=12 * STEPS, step_sleep=0.25
    )
    try:
        run = run_job(tmp_path, builder, on_tick=on_tick, chaos="kill-node@step=8", timeout_s=200)
    finally:
        stop.set()
        if state["thread"] is not None:
            state["thread"].join(timeout=30)
    writers: Writers = state["writers"]
    assert writers is not None, f"the job never reached step {START_AT_STEP}: {run.reasons()}"
    assert writers.written == {"foreign": FOREIGN_KEYS, "namespace": NAMESPACE_KEYS}, writers.written
    assert writers.front_closed == FOREIGN_KEYS + NAMESPACE_KEYS

    status = run.runtime.obj["status"]
    assert run.summary.succeeded, f"phase {run.summary.phase}: {run.summary.message}; events {run.reasons()}"
    assert (status.get("restarts") or {}).get("total", 0) == 0, f"restarts charged: {status.get('restarts')}"
    assert (status.get("infrastructureLosses") or {}).get("total") == 1, status.get("infrastructureLosses")
    events = run.events
    own = [e for e in events if e["type"] == "Warning" and e["reason"] in ("NodeLost", "NodeNotReady")]
    assert own, f"the job's own node-loss Warning is missing: {run.reasons()}"
    assert "ChaosKillNode" in run.reasons() and writers.started < own[0]["time"], "the loss came after the writers"

    rejected = status.get("storeRejections") or {}
    counts = rejected.get("counts") or {}
    assert counts.get("foreign/foreign") == FOREIGN_KEYS, f"foreign keys counted: {rejected}"
    assert rejected.get("total") == FOREIGN_KEYS + NAMESPACE_KEYS, f"every key past the front, once: {rejected}"
    assert sum(n for name, n in counts.items() if name.startswith("control/")) == NAMESPACE_KEYS, counts
    recent = rejected.get("recent") or []
    assert 0 < len(recent) <= 8, recent
    for entry in recent:
        assert _printable(entry["key"]) and len(entry["key"]) <= 120, f"a key shown as written: {entry['key']!r}"

    summaries = [e for e in events if e["reason"] == "StoreValueRejected"]
    minutes = math.ceil((events[-1]["time"] - writers.started) / 60.0)
    assert 1 <= len(summaries) <= minutes, f"{len(summaries)} summaries in {minutes} minute(s): {summaries}"
    assert all(e["type"] == "Warning" for e in summaries)
    for event in events:
        text = event["reason"] + event["message"]
        assert INSIDE not in text and OUTSIDE not in text and "node-fake" not in text, f"echoed: {event!r}"
    echoed = [s for s in _strings(status) if INSIDE in s and not _printable(s)]
    assert not echoed, f"the status holds a writer's text as written: {echoed[:1]!r}"
    assert not [s for s in _strings(status) if OUTSIDE in s], "a key of the stranger at the front was counted"
    events_file = run.state.events_file.read_text()
    assert INSIDE not in events_file and OUTSIDE not in events_file, "events.jsonl echoes a writer's key"
    json.dumps(status)  # the status stays JSON

    growth = state["peak"] - state["before"]
    assert state["before"] and growth <= 64 * MIB, f"the agent grew by {growth / MIB:.0f} MiB (allowed: 64 MiB)"
    agent_log = run.state.log_file("rejections-agent").read_text(errors="replace")
    assert agent_log.count("serving the store") == 1, "the agent was replaced"
