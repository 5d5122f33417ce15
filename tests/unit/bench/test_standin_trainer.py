"""The API-load benchmark's stand-in trainer follows directives as the workers do (bench/_jobs.py).

Why it matters: a stand-in that ignored them left every probed job's drain in flight for the rest of the benchmark,
so later probes were timed on a cluster no real job is ever in."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
from types import ModuleType
from typing import Any

from disttrain.api import control as keys

BENCH = pathlib.Path(__file__).resolve().parents[3] / "bench"


def _load_jobs_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_jobs", BENCH / "_jobs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


jobs = _load_jobs_module()


def _directive(store: Any, generation: int, action: str, nodes: int) -> None:
    store.set(keys.SIGNAL_KEY, keys.ControlSignal(generation=generation, action=action).model_dump_json())
    store.set(keys.TARGET_KEY, keys.TargetPlan(generation=generation, nodes=nodes).model_dump_json())


def _progress(store: Any) -> keys.ProgressReport:
    report = keys.read_model(store, keys.PROGRESS_KEY, keys.ProgressReport)
    assert report is not None
    return report


def _checkpoint_step(store: Any) -> int | None:
    return json.loads(store.get(keys.CHECKPOINT_KEY))["step"] if store.check([keys.CHECKPOINT_KEY]) else None


def test_a_drain_commits_the_last_step_and_the_next_round_runs_at_the_target_size() -> None:
    store = jobs.DictStore()
    trainer = jobs.SimulatedTrainer(store, run_id="job-1")
    _directive(store, 0, "none", 3)
    for _ in range(5):
        trainer.advance(checkpoint_every=100)
    before = _progress(store)
    assert (before.step, before.world_size, _checkpoint_step(store)) == (5, 3, None)

    _directive(store, 1, "drain", 2)
    trainer.advance(checkpoint_every=100)
    assert _checkpoint_step(store) == 5  # committed at the step boundary, before the group exits
    assert _progress(store).process_id == before.process_id  # no step of the old group after the drain

    trainer.advance(checkpoint_every=100)
    after = _progress(store)
    assert after.step == 6 and after.world_size == 2 and after.plan["worldSize"] == 2
    assert after.process_id != before.process_id  # a new rank-0 process: the agent counts a new round

    trainer.advance(checkpoint_every=100)
    assert _progress(store).process_id == after.process_id  # the same generation is acted on once


def test_a_reform_re_forms_without_a_checkpoint_and_the_directive_present_at_start_is_history() -> None:
    store = jobs.DictStore()
    _directive(store, 4, "drain", 2)  # issued before this group started: history
    trainer = jobs.SimulatedTrainer(store, run_id="job-2")
    trainer.advance(checkpoint_every=100)
    trainer.advance(checkpoint_every=100)
    first = _progress(store)
    assert (first.step, first.world_size) == (2, 3)

    _directive(store, 5, "reform", 1)
    trainer.advance(checkpoint_every=100)
    trainer.advance(checkpoint_every=100)
    after = _progress(store)
    assert _checkpoint_step(store) is None
    assert (after.step, after.world_size) == (3, 1) and after.process_id != first.process_id
