"""``status.lastReform`` says where a group re-formed in place took its state from, and why not memory."""

from __future__ import annotations

import pytest

from disttrain.api.status import DistTrainJobStatus, ReformRecord
from disttrain.operator import reconcile

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("from_memory", "note", "source", "recorded_note"),
    [
        (True, None, "memory", None),
        (False, "no step is whole in the members' memory", "checkpoint", "no step is whole in the members' memory"),
        (None, None, None, None),
    ],
    ids=["memory", "checkpoint-with-reason", "not-in-place"],
)
def test_the_reform_record_names_the_state_source(from_memory, note, source, recorded_note):
    status = DistTrainJobStatus(resumed_from_memory=from_memory, recovery_note=note)
    record = ReformRecord(reason="NodeLost")
    reconcile._note_state_source(record, status)
    assert (record.resumed_from, record.note) == (source, recorded_note)
    dumped = record.model_dump(by_alias=True, exclude_none=True)
    assert ("resumedFrom" in dumped) is (source is not None)
