"""bench/scale_sim.py in small: four simulated nodes (the real rendezvous handler, signed store, beats and beacons)
against a real job agent process; one node's machine dies, the agent reports it and the survivors re-form."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)
BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "scale_sim.py"


def test_four_simulated_nodes_rendezvous_and_reform_without_the_lost_one():
    small = ["--nodes", "4", "--processes", "1", "--settle", "1", "--window", "1", "--timeout", "60"]
    run = subprocess.run(
        [sys.executable, str(BENCH), *small],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    figures = dict(line.split(": ", 1) for line in run.stdout.splitlines() if ": " in line)
    assert figures["round_members_in_steady_window"] == "4", "the agent sees every node in the round"
    assert figures["silent_in_steady_window"] == "0", "no beating node is reported silent"
    assert figures["stalled_in_steady_window"] == "0", "ranks beaconing every step are not stalled"
    assert not figures["detect_seconds"].startswith("none"), "the stopped node is reported silent"
    assert figures["reformed_world_nodes"] == "3", "every survivor's next round holds the three survivors"
