"""bench/agent_load.py in small: eight nodes' beats and their ranks' beacons, written to the wire by the benchmark's
generator, reach a real job agent process as the product's own clients would write them; then one node falls
silent and the agent reports it."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)
BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "agent_load.py"


def test_the_generated_load_is_read_by_the_agent_as_a_round_of_live_nodes():
    small = ["--nodes", "8", "--nproc", "2", "--processes", "1", "--settle", "1", "--window", "3", "--timeout", "60"]
    run = subprocess.run([sys.executable, str(BENCH), *small], capture_output=True, text=True, timeout=110)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    figures = dict(line.split(": ", 1) for line in run.stdout.splitlines() if ": " in line)
    offered = dict(part.split() for part in figures["offered_per_second"].split(", "))
    delivered = dict(part.split() for part in figures["delivered_per_second"].split(", "))
    for kind in ("beats", "beacons"):
        assert float(delivered[kind]) >= 0.8 * float(offered[kind]), (kind, offered, delivered)
    assert figures["round_members"] == "8", "the agent reads the round the benchmark wrote"
    assert figures["most_silent_at_once"] == "0", "every generated beat verified and fresh"
    assert figures["most_stalled_at_once"] == "0", "every generated beacon verified and advancing"
    assert not figures["detect_seconds"].startswith("none"), "the silenced node is reported"
