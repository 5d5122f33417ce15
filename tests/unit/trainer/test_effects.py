"""The side-effect ledger: what a save records, what a commit makes due, what a resume owes, what is confirmed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from tests.manifests import bare_manifest

from disttrain.api.manifest import CheckpointManifest, EffectRecord
from disttrain.trainer import effects
from disttrain.trainer.evaluation import jsonable, rank_batches


class Sink:
    """A downstream handler that keeps every call (and can be told to fail)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.failing = False

    def __call__(self, key: str, payload: dict[str, Any]) -> None:
        if self.failing:
            raise RuntimeError("downstream is down")
        self.calls.append((key, payload))


def ledger(root: Path, sink: Sink, run_id: str = "run-a", runner: bool = True) -> effects.EffectLedger:
    return effects.EffectLedger({"notify": sink}, run_id, root, runner=runner)


def manifest(step: int, records: list[EffectRecord]) -> CheckpointManifest:
    return bare_manifest(step, effects=records)


def test_a_declaration_is_carried_out_only_after_the_save_covering_its_step_commits(tmp_path):
    sink = Sink()
    led = ledger(tmp_path, sink)
    key = led.declare("notify", {"n": 1}, step=1)
    led.declare("notify", {"n": 2}, step=2)
    assert key == "run-a/1/notify"
    recorded = led.record_for(1)
    assert [r.step for r in recorded] == [1]  # step 2 is not covered by the save of step 1
    assert led.carry_out() == 0 and not sink.calls  # saved, not committed
    led.note_committed(1)
    assert led.carry_out() == 1
    assert sink.calls == [("run-a/1/notify", {"n": 1})]
    assert [r.step for r in led.declared] == [2]
    assert (tmp_path / "effects" / "1-notify.json").exists()


def test_a_failed_save_keeps_its_declarations_for_the_next_save(tmp_path):
    led = ledger(tmp_path, Sink())
    led.declare("notify", {}, step=1)
    led.record_for(1)  # this save fails: the loop never sees step 1 committed
    led.declare("notify", {}, step=2)
    assert [r.step for r in led.record_for(2)] == [1, 2]
    led.note_committed(None)  # nothing committed yet
    assert [r.step for r in led.declared] == [1, 2]
    led.note_committed(2)
    assert [r.step for r in led.due] == [1, 2] and led.declared == []


def test_a_failing_handler_is_retried_with_the_same_key_and_recorded_by_later_saves(tmp_path):
    sink = Sink()
    led = ledger(tmp_path, sink)
    led.declare("notify", {}, step=1)
    led.record_for(1)
    led.note_committed(1)
    sink.failing = True
    assert led.carry_out() == 0
    assert [r.key for r in led.record_for(3)] == ["run-a/1/notify"]  # the next checkpoint still records it
    sink.failing = False
    assert led.carry_out() == 1
    assert [k for k, _ in sink.calls] == ["run-a/1/notify"]
    assert led.record_for(5) == []


def test_a_resume_owes_what_the_commit_holds_and_no_confirmation_covers_with_the_declarers_key(tmp_path):
    first = ledger(tmp_path, Sink())
    for step in (1, 2):
        first.declare("notify", {"step": step}, step)
    records = first.record_for(2)
    first.note_committed(2)
    first.confirmations.confirm(records[0])  # step 1 confirmed, then the process died
    sink = Sink()
    later = ledger(tmp_path, sink, run_id="run-b")
    later.restore(manifest(2, records), resumed_step=2)
    assert later.carry_out() == 1
    assert sink.calls == [("run-a/2/notify", {"step": 2})]  # the key of the run that declared it
    again = ledger(tmp_path, Sink(), run_id="run-c")
    again.restore(manifest(2, records), resumed_step=2)
    assert again.due == []


def test_only_the_runner_carries_out_and_declarations_of_redone_steps_are_dropped(tmp_path):
    sink = Sink()
    led = ledger(tmp_path, sink, runner=False)
    led.declare("notify", {}, step=3)
    led.record_for(4)
    led.note_committed(4)
    assert led.carry_out() == 0 and not sink.calls and led.due == []
    led.declare("notify", {}, step=5)
    led.declare("notify", {}, step=6)
    led.restore(manifest(4, []), resumed_step=5)  # resumed at 5 (in place): step 6 will be redone
    assert [r.step for r in led.declared] == [5]


def test_a_step_redone_declares_again_and_the_later_declaration_wins(tmp_path):
    led = ledger(tmp_path, Sink())
    led.declare("notify", {"try": 1}, step=3)
    led.declare("notify", {"try": 2}, step=3)
    assert [r.payload for r in led.record_for(3)] == [{"try": 2}]


def test_a_confirmation_of_the_same_step_by_another_run_counts_and_a_garbled_one_does_not(tmp_path):
    record = effects.make_record("notify", {}, 4, "run-a")
    marks = effects.Confirmations(tmp_path)
    marks.confirm(effects.make_record("notify", {}, 4, "run-z"))
    assert marks.is_confirmed(record)
    marks.path(record).write_text("{not json")
    assert not marks.is_confirmed(record)
    marks.path(record).unlink()
    os.symlink(tmp_path / "elsewhere.json", marks.path(record))
    assert not marks.is_confirmed(record)  # never followed


def test_confirmations_refuse_an_effects_directory_that_is_a_link(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "ckpt")
    (tmp_path / "ckpt-root").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "ckpt-root" / "effects")
    with pytest.raises(OSError, match="never followed"):
        effects.Confirmations(tmp_path / "ckpt-root").confirm(effects.make_record("notify", {}, 1, "r"))
    assert list((tmp_path / "real").iterdir()) == []


@pytest.mark.parametrize(
    "name, payload, message",
    [
        ("Upload", {}, "not allowed"),
        ("../x", {}, "not allowed"),
        ("notify", {"t": object()}, "JSON object"),
        ("notify", {"x": float("nan")}, "JSON object"),
        ("notify", {"blob": "x" * 5000}, "at most 4096"),
    ],
    ids=["upper-case", "path", "not-json", "nan", "too-large"],
)
def test_a_declaration_is_checked_when_made(name, payload, message):
    with pytest.raises(ValueError, match=message):
        effects.make_record(name, payload, 1, "r")


def test_an_effect_without_a_handler_is_refused_when_declared_and_kept_when_recorded(tmp_path):
    led = ledger(tmp_path, Sink())
    with pytest.raises(ValueError, match="has no handler"):
        led.declare("upload", {}, 1)
    led.restore(manifest(2, [effects.make_record("upload", {}, 2, "run-a")]), resumed_step=2)
    assert led.carry_out() == 0
    assert [r.name for r in led.due] == ["upload"]  # stays owed until a run registers it


def test_evaluation_batches_give_every_rank_the_same_number_of_rounds_and_every_sample_once():
    shares = [rank_batches(10, 3, 2, r) for r in range(2)]
    assert [len(s) for s in shares] == [2, 2]
    assert sorted(i for s in shares for b in s for i in b) == list(range(10))
    assert shares[1][1] == [9] and rank_batches(2, 3, 2, 1) == [[]]  # an empty round is a padding batch
    assert jsonable({"loss": float("nan"), "n": 2.0}) == {"loss": "nan", "n": 2.0}


def test_a_resume_from_a_commit_not_in_the_bucket_holds_its_effects_until_a_save_is_durable(tmp_path):
    """A local copy the bucket does not hold dies with the node: its effects run only once a later save that
    records them is COMPLETE in the bucket, so a resume from the bucket's older step never meets them twice."""
    sink = Sink()
    first = ledger(tmp_path / "node-a", sink, run_id="run-a")
    first.declare("notify", {"n": 4}, step=4)
    local = manifest(4, first.record_for(4))  # committed on the local tier, not yet COMPLETE in the bucket
    resumed = ledger(tmp_path / "node-a", sink, run_id="run-b")
    resumed.restore(local, resumed_step=4, durable=False)
    assert resumed.carry_out() == 0 and not sink.calls
    resumed.declare("notify", {"n": 6}, step=6)
    recorded = resumed.record_for(6)
    assert [r.key for r in recorded] == ["run-a/4/notify", "run-b/6/notify"]  # the bucket's copy records both
    resumed.note_committed(6)
    assert resumed.carry_out() == 2
    assert [k for k, _ in sink.calls] == ["run-a/4/notify", "run-b/6/notify"]


def test_a_resume_from_a_durable_commit_carries_its_effects_out_at_once(tmp_path):
    sink = Sink()
    first = ledger(tmp_path, sink, run_id="run-a")
    first.declare("notify", {}, step=3)
    resumed = ledger(tmp_path / "other-node", sink, run_id="run-b")
    resumed.restore(manifest(3, first.record_for(3)), resumed_step=3, durable=True)
    assert resumed.carry_out() == 1 and [k for k, _ in sink.calls] == ["run-a/3/notify"]
