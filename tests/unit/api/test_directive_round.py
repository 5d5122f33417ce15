"""The rule a worker applies to the directive it reads: a directive is bound to the rendezvous round it was issued
for, and a generation at or below the worker's history is never acted on."""

from __future__ import annotations

import pytest

from disttrain.api import control
from disttrain.api.control import DirectiveVerdict, judge_directive


def directive(generation: int, round_: int, uid: str = "uid-1", action: str = "reform") -> control.ControlSignal:
    return control.ControlSignal(generation=generation, action=action, job_uid=uid, round=round_)


def test_a_new_directive_for_the_workers_round_is_acted_on() -> None:
    assert judge_directive(directive(4, 2), job_uid="uid-1", history=3, worker_round=2) is DirectiveVerdict.ACT


def test_a_directive_for_a_later_round_than_the_workers_is_acted_on() -> None:
    """The worker's group is behind the round the agent saw complete: it is stale, and the directive is for it too."""
    assert judge_directive(directive(4, 3), job_uid="uid-1", history=3, worker_round=2) is DirectiveVerdict.ACT


def test_a_directive_issued_for_an_earlier_round_is_not_acted_on_whatever_the_history() -> None:
    """The replay of the attack: the worker's history was lowered to 1, the directive that formed its round (3,
    issued in round 1) comes back; it was issued for round 1 and this worker is of round 2."""
    verdict = judge_directive(directive(3, 1), job_uid="uid-1", history=1, worker_round=2)
    assert verdict is DirectiveVerdict.EARLIER_ROUND


def test_a_generation_below_the_history_is_an_older_directive_and_never_acted_on() -> None:
    verdict = judge_directive(directive(2, 5), job_uid="uid-1", history=3, worker_round=5)
    assert verdict is DirectiveVerdict.OLDER


def test_the_generation_already_seen_is_not_acted_on_again() -> None:
    assert judge_directive(directive(3, 2), job_uid="uid-1", history=3, worker_round=2) is DirectiveVerdict.SEEN


@pytest.mark.parametrize(("issued_for", "worker_round"), [(control.NO_ROUND, 7), (1, control.NO_ROUND)])
def test_a_round_unknown_on_either_side_leaves_the_decision_to_the_generation(
    issued_for: int, worker_round: int
) -> None:
    """A directive published before the agent saw a round complete, or a worker started without the disttrain
    rendezvous (plain torchrun): the generation alone decides."""
    verdict = judge_directive(directive(4, issued_for), job_uid="uid-1", history=3, worker_round=worker_round)
    assert verdict is DirectiveVerdict.ACT


def test_another_jobs_directive_is_foreign() -> None:
    verdict = judge_directive(directive(9, 9, uid="uid-old"), job_uid="uid-1", history=0, worker_round=0)
    assert verdict is DirectiveVerdict.FOREIGN


@pytest.mark.parametrize(
    ("round_", "complete", "issued_for"), [(0, False, control.NO_ROUND), (0, True, 0), (3, False, 2), (3, True, 3)]
)
def test_a_directive_is_issued_for_the_last_complete_round(round_: int, complete: bool, issued_for: int) -> None:
    """While round n + 1 forms (its workers not started yet), a directive is for round n's group: the group forming
    takes its target plan as it completes, and its workers must not leave it again for that directive."""
    assert control.last_complete_round(round_, complete) == issued_for


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("4", 4),
        (" 12 ", 12),
        (None, control.NO_ROUND),
        ("", control.NO_ROUND),
        ("-3", control.NO_ROUND),
        ("x", control.NO_ROUND),
        ("9" * 40, control.NO_ROUND),
    ],
)
def test_the_workers_round_is_read_from_its_environment_or_unknown(value: str | None, parsed: int) -> None:
    assert control.parse_round(value) == parsed


def test_a_round_is_bounded_and_a_directive_without_one_reads_as_unknown() -> None:
    assert control.ControlSignal.model_validate_json('{"generation": 1, "action": "drain"}').round == control.NO_ROUND
    with pytest.raises(ValueError, match="round"):
        control.ControlSignal(generation=1, action="drain", round=-2)
