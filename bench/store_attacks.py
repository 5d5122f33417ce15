"""The job agent's peak memory under each attack class of a stranger without the secret, side by side in one run.

One local job (the e2e recorder, 2 nodes, its agent pulsing as on a cluster) trains while
``tests/security/outsider.py`` attacks its agent, one class after another, each for ``--seconds``, the agent's
high-water mark reset before each. The classes are the rows of docs/security.md's store-front threat, each on its
own: raw on the wire, 8 MiB queue entries, 48 pipelined reads never read, 8 MiB values one byte short, 8191-byte key
names, an 8 MiB append, 1,000 idle connections; a TCPStore client's forged values and its 8 MiB flood; what a
sniffer of the network saw replayed (the directive) and garbled (the step beacons); every unproven place of the
pulse port held. Printed, one line per class: the agent's peak RSS during it (its process tree's VmRSS summed,
sampled every 0.1 s, and VmHWM) and its growth over its RSS as the class began; then the agent's RSS at the start
of the attacks, and whether the job kept training with no restart.

    python bench/store_attacks.py [--seconds 6] [--classes queue,append]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from typing import Any, Optional

import _localbench
from tests.security import agentmemory, sniffed

from disttrain.operator.local.runtime import LocalRuntime, Snapshot

OUTSIDER = _localbench.REPO / "tests" / "security" / "outsider.py"
RAW = ["raw", "--hold", "0", "--raw"]
CLASSES: dict[str, list[str]] = {
    "queue": [*RAW, "queue"],
    "pipelined_get": [*RAW, "pipelined-get"],
    "half_sent": [*RAW, "half-sent"],
    "key_names": [*RAW, "key-names"],
    "append": [*RAW, "append"],
    "idle_connections": ["raw", "--hold", "1000", "--raw", "none"],
    "client_forge": ["forge"],
    "client_flood": ["flood", "--max-flood-mb", "2048"],
    "replay": ["replay"],
    "beacons": ["beacons"],
    "pulse_port": ["pulse"],
}
"""Attack class -> the outsider's arguments after the store's address."""
SNIFFING = ("replay", "beacons", "pulse_port")
MIB = 2**20


class Attacks(threading.Thread):
    """Runs the classes one after the other against the running job's agent and measures each; stops the job."""

    def __init__(self, runtime: LocalRuntime, classes: list[str], seconds: float, workdir: Any) -> None:
        super().__init__(name="attacks", daemon=True)
        self.runtime = runtime
        self.classes = classes
        self.seconds = seconds
        self.workdir = workdir
        self.figures: dict[str, tuple[int, int]] = {}
        """Class -> (RSS as it began, peak during it) in bytes."""
        self.first_rss = 0
        self.ops: dict[str, int] = {}

    def run(self) -> None:
        try:
            sniff_file = self.workdir / "sniffed.json"
            sniff_file.write_text(json.dumps(sniffed.sniff(self.runtime, 2)))
            for name in self.classes:
                self.figures[name] = self.attack(name, sniff_file)
                time.sleep(1.0)
        finally:
            self.runtime.stop("the attacks are over")

    def attack(self, name: str, sniff_file: Any) -> tuple[int, int]:
        pids = agentmemory.agent_pids(self.runtime)
        agentmemory.reset_peaks(pids)
        before, _ = agentmemory.rss_of(pids)
        self.first_rss = self.first_rss or before
        report = self.workdir / f"{name}.json"
        argv = [sys.executable, str(OUTSIDER), f"127.0.0.1:{self.runtime.store_port}", *CLASSES[name]]
        argv += ["--seconds", str(self.seconds), "--report", str(report)]
        if name in SNIFFING:
            argv += ["--sniffed", str(sniff_file)]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        peak = before
        while proc.poll() is None:
            rss, hwm = agentmemory.rss_of(agentmemory.agent_pids(self.runtime))
            peak = max(peak, rss, hwm)
            time.sleep(0.1)
        rss, hwm = agentmemory.rss_of(agentmemory.agent_pids(self.runtime))
        peak = max(peak, rss, hwm)
        if report.exists():  # what it did and what failed (a TCPStore client's refused connections)
            done = json.loads(report.read_text())
            self.ops[name] = sum(done.get("ops", {}).values()) + sum(done.get("errors", {}).values())
        print(f"# {name}: {self.ops.get(name, 0)} outsider attempts, peak {peak / MIB:.0f} MiB", flush=True)
        return before, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="how long each class attacks (default 6)")
    parser.add_argument("--classes", default=",".join(CLASSES), help="which classes, joined by commas (default all)")
    args = parser.parse_args()
    classes = args.classes.split(",")
    wrong = [name for name in classes if name not in CLASSES]
    if wrong:
        parser.error(f"--classes: {', '.join(wrong)} not among {', '.join(CLASSES)}")
    workdir = _localbench.workdir("store-attacks")
    out = workdir / "records"
    obj = _localbench.recorder_job("attacks", out, replicas=2, max_steps=100_000, step_sleep=0.2)
    holder: dict[str, Optional[Attacks]] = {"attacks": None}

    def on_tick(runtime: LocalRuntime, snapshot: Snapshot) -> None:
        if holder["attacks"] is None and snapshot.status.get("step", 0) >= 3:
            holder["attacks"] = Attacks(runtime, classes, args.seconds, workdir)
            holder["attacks"].start()

    budget = 300 + len(classes) * (args.seconds + 15)
    runtime = _localbench.run(obj, workdir / "state", on_tick=on_tick, timeout_s=budget, pulse_key=bytes(32))
    attacks = holder["attacks"]
    if attacks is None:
        sys.exit(f"the job never trained: {[e['reason'] for e in runtime.events]}")
    attacks.join(timeout=30)
    restarts = (runtime.obj["status"].get("restarts") or {}).get("total", 0)
    print(f"agent_rss_mb_before_attacks: {attacks.first_rss / MIB:.0f}")
    for name, (_before, peak) in attacks.figures.items():
        print(f"peak_agent_rss_mb.{name}: {peak / MIB:.0f}")
    for name, (before, peak) in attacks.figures.items():
        print(f"agent_growth_mb.{name}: {(peak - before) / MIB:.0f}")
    print(f"steps_trained: {runtime.obj['status'].get('step', 0)}")
    print(f"restarts_charged: {restarts}")


if __name__ == "__main__":
    main()
