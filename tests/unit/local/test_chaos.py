"""--chaos parsing: every form, and errors that name the item and what is allowed."""

import pytest

from disttrain.operator.local.chaos import ChaosEvent, ChaosSyntaxError, parse_chaos


@pytest.mark.parametrize(
    "text, expected",
    [
        ("kill-node@30s", [ChaosEvent("kill-node", at_seconds=30)]),
        ("kill-node:2@1.5m", [ChaosEvent("kill-node", at_seconds=90, index=2)]),
        (
            "add-node@60, kill-agent@90s",
            [ChaosEvent("add-node", at_seconds=60), ChaosEvent("kill-agent", at_seconds=90)],
        ),
        (
            "kill-agent@90s,kill-node@30s",
            [ChaosEvent("kill-node", at_seconds=30), ChaosEvent("kill-agent", at_seconds=90)],
        ),
        ("remove-node@step=40", [ChaosEvent("remove-node", at_step=40)]),
        ("", []),
    ],
    ids=["seconds", "index-minutes", "several", "sorted-by-time", "by-step", "empty"],
)
def test_chaos_items_parse(text, expected):
    assert parse_chaos(text) == expected


@pytest.mark.parametrize(
    "text, needle",
    [
        ("explode@3s", "unknown action 'explode'"),
        ("kill-node", "expected ACTION[:INDEX]@TIME"),
        ("add-node:1@3s", "only kill-node and drain-node take a node index"),
        ("kill-node@soon", "expected ACTION[:INDEX]@TIME"),
    ],
    ids=["unknown-action", "no-time", "index-on-add", "bad-time"],
)
def test_bad_chaos_items_are_refused_by_name(text, needle):
    with pytest.raises(ChaosSyntaxError, match="--chaos item") as error:
        parse_chaos(text)
    assert needle in str(error.value)


def test_events_fire_by_time_or_by_step():
    assert ChaosEvent("kill-node", at_seconds=5).is_due(elapsed=5.0, step=0)
    assert not ChaosEvent("kill-node", at_seconds=5).is_due(elapsed=4.9, step=100)
    assert ChaosEvent("kill-node", at_step=8).is_due(elapsed=0, step=9)
    assert not ChaosEvent("kill-node", at_step=8).is_due(elapsed=1000, step=7)
