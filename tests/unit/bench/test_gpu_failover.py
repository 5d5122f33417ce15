"""The GPU failover benchmark's pure parts: per-step records into lost steps, loss trajectories and a GPU plan.

Why it matters: the script runs once on a lent GPU machine with minutes of device time; a wrong count or diff found
there cannot be measured again."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType
from typing import Any

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[3] / "bench"


def _load_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gpu_failover", BENCH / "gpu_failover.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gf = _load_module()


def rec(step: int, group: str, time: float, *, rank: int = 0, world: int = 2, loss: float = 1.0) -> dict[str, Any]:
    return {"step": step, "group": group, "time": time, "rank": rank, "world": world, "loss_sum": loss, "count": 2}


def run_of(groups: list[tuple[str, range, float]]) -> list[dict[str, Any]]:
    """Records of two ranks for each (group, steps, start time), a step every 0.1 s."""
    out = []
    for group, steps, start in groups:
        for i, step in enumerate(steps):
            out += [rec(step, group, start + i * 0.1, rank=r) for r in (0, 1)]
    return out


def test_a_step_run_again_by_a_later_group_counts_as_redone() -> None:
    records = run_of([("old", range(1, 16), 0.0), ("new", range(11, 41), 10.0)])
    assert gf.lost_steps(records, 40) == (5, 0)


def test_a_step_no_group_ran_counts_as_never_run() -> None:
    records = run_of([("old", range(1, 10), 0.0), ("new", range(11, 41), 10.0)])
    assert gf.lost_steps(records, 40) == (0, 1)


def test_group_leave_events_are_not_steps() -> None:
    records = [*run_of([("g", range(1, 4), 0.0)]), {"event": "leave", "how": "abort", "began": 1.0, "seconds": 0.2}]
    assert gf.lost_steps(records, 3) == (0, 0)
    assert sorted(gf.executions(records)) == [1, 2, 3]


def test_the_loss_of_a_step_is_its_last_executions_mean_over_ranks() -> None:
    records = [
        rec(1, "old", 0.0, rank=0, loss=9.0),
        rec(1, "new", 5.0, rank=0, world=1, loss=2.0),
        rec(1, "new", 5.0, rank=0, world=1, loss=4.0),
    ]
    assert gf.final_losses(records) == {1: gf.StepLoss(6.0 / 4, 1)}


@pytest.mark.parametrize(
    ("other", "expected"),
    [
        pytest.param({3: (0.5, 2), 4: (0.25, 2)}, (2, 0.0, 2, 0.0, True), id="bitwise-equal"),
        pytest.param({3: (0.5, 2), 4: (0.3, 2)}, (2, 0.05, 2, 0.05, False), id="differs-at-same-world"),
        pytest.param({3: (0.5, 1), 4: (0.3, 2)}, (2, 0.05, 1, 0.05, False), id="one-step-at-another-world"),
        pytest.param({3: (0.6, 1), 4: (0.25, 2)}, (2, 0.1, 1, 0.0, True), id="only-the-other-world-differs"),
        pytest.param({1: (9.0, 2), 3: (0.5, 2)}, (1, 0.0, 1, 0.0, True), id="steps-before-the-kill-ignored"),
    ],
)
def test_trajectory_diff_compares_steps_after_the_kill(
    other: dict[int, tuple[float, int]], expected: tuple[Any, ...]
) -> None:
    reference = {1: gf.StepLoss(1.0, 2), 2: gf.StepLoss(0.75, 2), 3: gf.StepLoss(0.5, 2), 4: gf.StepLoss(0.25, 2)}
    diff = gf.trajectory_diff(reference, {s: gf.StepLoss(*v) for s, v in other.items()}, after=2)
    assert tuple(diff) == pytest.approx(expected)


def test_median_step_time_skips_warm_up_steps() -> None:
    times = [0.0, 1.0, 1.5, 1.51, 1.52, 1.53, 1.54]
    assert gf.median_step_ms(times, skip=3) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="raise --steps"):
        gf.median_step_ms(times[:4], skip=3)


def test_the_first_step_after_the_kill_is_the_new_groups() -> None:
    records = run_of([("old", range(1, 16), 0.0), ("new", range(11, 41), 10.0)])
    assert gf.first_step_after(records, 1.0, {"old"}) == pytest.approx(10.0)
    assert gf.first_step_after(records, 100.0, {"old"}) is None


@pytest.mark.parametrize(
    ("requested", "device", "gpus", "nodes", "nproc", "scenario", "runs", "noted"),
    [
        pytest.param("auto", "cpu", 0, 2, 1, "kill", 2, False, id="cpu-needs-no-gpu"),
        pytest.param("auto", "cuda", 2, 2, 1, "kill", 2, False, id="a-gpu-per-node"),
        pytest.param("auto", "cuda", 8, 2, 4, "kill", 2, False, id="four-gpus-per-node"),
        pytest.param("auto", "cuda", 1, 2, 1, "abort", 1, True, id="one-gpu-aborts-a-reduction"),
        pytest.param("auto", "cuda", 4, 2, 4, "abort", 1, True, id="gpus-for-one-node-only"),
        pytest.param("abort", "cuda", 8, 2, 1, "abort", 1, False, id="abort-asked-for"),
    ],
)
def test_each_rank_needs_a_gpu_of_its_own(
    requested: str, device: str, gpus: int, nodes: int, nproc: int, scenario: str, runs: int, noted: bool
) -> None:
    plan = gf.plan_scenario(requested, device, gpus, nodes, nproc)
    assert (plan.name, plan.nodes) == (scenario, runs)
    assert bool(plan.note) is noted


@pytest.mark.parametrize(
    ("requested", "device", "gpus", "nproc", "message"),
    [
        pytest.param("auto", "cuda", 1, 2, "nproc-per-node=2", id="fewer-gpus-than-one-nodes-processes"),
        pytest.param("abort", "cpu", 0, 1, "needs CUDA", id="abort-on-the-cpu"),
        pytest.param("kill", "cuda", 1, 1, "needs 2 x 1 GPUs", id="kill-without-a-gpu-per-rank"),
    ],
)
def test_what_cannot_run_is_refused(requested: str, device: str, gpus: int, nproc: int, message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        gf.plan_scenario(requested, device, gpus, 2, nproc)


def test_stall_steps_are_ascending_step_numbers() -> None:
    assert gf.parse_steps("30,70") == (30, 70)
    for bad in ("70,30", "1", "x", ""):
        with pytest.raises(ValueError, match="--stall-at"):
            gf.parse_steps(bad)


def test_a_stall_outlasts_the_timeout_and_the_watchdogs_dump_waits() -> None:
    assert gf.stall_seconds(10, 1000) > 10 + 4 * 1.0
    assert gf.sleep_cycles(2.0, 1.5e9) == 3_000_000_000


def stall(step: int, time: float, pid: int = 11) -> dict[str, Any]:
    return {"event": "stall", "step": step, "time": time, "pid": pid}


def with_pid(records: list[dict[str, Any]], pid: int) -> list[dict[str, Any]]:
    return [dict(r, pid=pid) for r in records]


def test_an_aborted_step_redone_by_the_next_group_in_the_same_process_did_not_count() -> None:
    records = with_pid(run_of([("old", range(1, 31), 0.0), ("new", range(30, 41), 40.0)]), 11)
    outcome = gf.abort_outcome(records, stall(30, 2.95))
    assert outcome == gf.AbortOutcome(False, 30, pytest.approx(37.05), True)


def test_an_aborted_step_the_next_group_went_past_counted_and_a_restart_is_another_process() -> None:
    records = [
        *with_pid(run_of([("old", range(1, 31), 0.0)]), 11),
        *with_pid(run_of([("new", range(31, 41), 40.0)]), 12),
    ]
    outcome = gf.abort_outcome(records, stall(30, 2.95))
    assert (outcome.counted, outcome.next_group_first_step, outcome.same_process) == (True, 31, False)


def test_without_a_next_group_the_outcome_is_unknown() -> None:
    records = with_pid(run_of([("old", range(1, 31), 0.0)]), 11)
    assert gf.abort_outcome(records, stall(30, 2.95)) == gf.AbortOutcome(None, None, None, None)


def test_only_dumps_written_after_the_stall_count(tmp_path: pathlib.Path) -> None:
    (tmp_path / "nccl_trace_rank_0").write_bytes(b"trace")
    (tmp_path / "nccl_trace_rank_1.tmp42").write_bytes(b"half")
    (tmp_path / "other").write_bytes(b"x")
    files = gf.flight_recorder_files(tmp_path)
    assert list(files) == ["nccl_trace_rank_0"] and files["nccl_trace_rank_0"][1] == 5
    mtime = files["nccl_trace_rank_0"][0]
    assert gf.dumps_written_after(files, mtime - 1) == files
    assert gf.dumps_written_after(files, mtime + 1) == {}
