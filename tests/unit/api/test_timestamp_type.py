"""Status times: Unix seconds in memory, RFC 3339 with milliseconds in the status as stored."""

from __future__ import annotations

import pydantic
import pytest

from disttrain.api.status import DistTrainJobStatus


def test_a_status_time_is_a_number_in_memory_and_the_same_string_in_the_status():
    wire = {"startTime": "2024-05-01T12:00:00.250Z", "control": {"issuedAt": "2024-05-01T12:00:01.000Z"}}
    status = DistTrainJobStatus.model_validate(wire)
    assert status.start_time == 1714564800.25 and status.control.issued_at == 1714564801.0
    status.completion_time = status.start_time + 59.75  # policies add and compare without conversions
    dumped = status.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert dumped["startTime"] == "2024-05-01T12:00:00.250Z" and dumped["completionTime"] == "2024-05-01T12:01:00.000Z"
    assert dumped["control"]["issuedAt"] == "2024-05-01T12:00:01.000Z"
    assert DistTrainJobStatus.model_validate(dumped).model_dump(mode="json", by_alias=True, exclude_none=True) == dumped


def test_a_time_that_is_no_rfc_3339_string_is_refused_naming_the_field():
    with pytest.raises(pydantic.ValidationError, match="startTime"):
        DistTrainJobStatus.model_validate({"startTime": "yesterday"})
