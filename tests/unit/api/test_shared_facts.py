"""The facts both layers read from api/: each has one definition, and these tests pin what it means."""

from __future__ import annotations

import logging

import pytest

from disttrain.api import containers, control, status, timestamps
from disttrain.api.contract import job_checkpoint_dir
from disttrain.api.status import DistTrainJobStatus


class DictStore:
    """The two calls read_model makes on a torch Store, over a dict (the store itself is not under test)."""

    def __init__(self, **values: bytes) -> None:
        self.values = values

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        return self.values[key]


def test_read_model_parses_what_is_stored():
    store = DictStore(**{control.SIGNAL_KEY: b'{"generation": 3, "action": "drain", "reason": "ScaledDown"}'})
    signal = control.read_model(store, control.SIGNAL_KEY, control.ControlSignal)
    assert signal is not None and signal.generation == 3 and signal.action is control.DirectiveAction.DRAIN


@pytest.mark.parametrize("values", [{}, {control.SIGNAL_KEY: b""}], ids=["absent", "empty"])
def test_read_model_returns_none_without_a_value(values):
    assert control.read_model(DictStore(**values), control.SIGNAL_KEY, control.ControlSignal) is None


def test_read_model_warns_and_returns_none_on_a_value_that_does_not_parse(caplog):
    store = DictStore(**{control.TARGET_KEY: b'{"generation": "x"}'})
    with caplog.at_level(logging.WARNING, logger="disttrain.control"):
        assert control.read_model(store, control.TARGET_KEY, control.TargetPlan) is None
    assert "TargetPlan" in caplog.text and control.TARGET_KEY in caplog.text


def test_every_agent_field_is_a_status_field():
    aliases = {info.alias for info in DistTrainJobStatus.model_fields.values()}
    assert set(status.AGENT_FIELDS) <= aliases


@pytest.mark.parametrize(
    "names, expected",
    [
        (["trainer"], 0),
        (["sidecar", "trainer"], 1),
        (["only"], 0),
        (["a", "b"], None),
        ([], None),
    ],
    ids=["named", "named-among-others", "the-only-one", "two-unnamed", "none"],
)
def test_trainer_container_is_the_named_one_or_the_only_one(names, expected):
    pod_containers = [{"name": n} for n in names]
    assert containers.find_trainer_index(pod_containers) == expected
    if expected is None:
        with pytest.raises(ValueError, match="named 'trainer'"):
            containers.trainer_index(pod_containers)


@pytest.mark.parametrize("root", ["/ckpt", "/ckpt/"], ids=["plain", "trailing-slash"])
def test_job_checkpoint_dir(root):
    assert job_checkpoint_dir(root, "ns", "job") == "/ckpt/ns/job"


def test_times_round_trip_with_milliseconds():
    text = timestamps.format_time(1_700_000_000.25)
    assert text == "2023-11-14T22:13:20.250Z"
    assert timestamps.parse_time(text) == 1_700_000_000.25
    assert timestamps.format_time_seconds(1_700_000_000.9) == "2023-11-14T22:13:20Z"
    assert timestamps.parse_time(None) is None


@pytest.mark.parametrize(
    "issued, committed, expected",
    [(100.0, 100.0, True), (100.0, 100.5, True), (100.0, 99.9, False), (None, 100.0, False), (100.0, None, False)],
    ids=["same-instant", "after", "before", "no-directive-time", "no-checkpoint"],
)
def test_drain_checkpoint_is_one_committed_at_or_after_the_directive(issued, committed, expected):
    """The operator deletes a drain's victims on it, and the agent writes it at once: one rule for both."""
    assert control.is_drain_checkpoint(issued, committed) is expected
