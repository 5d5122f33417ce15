"""A collective desync (torch's fingerprint mismatch under TORCH_DISTRIBUTED_DEBUG=DETAIL) is named, never re-formed."""

import pytest

from disttrain.api import conditions
from disttrain.api.conditions import Reason
from disttrain.trainer import failures

_OPTIONS = (
    "TensorOptions(dtype=float (default), device=cpu, layout=Strided (default), requires_grad=false (default), "
    "pinned_memory=false (default), memory_format=(nullopt))"
)


def fingerprint(seq: int, op: str, shape: str) -> str:
    return (
        f"CollectiveFingerPrint(SequenceNumber={seq}, OpType={op}, TensorShape={shape}, TensorDtypes=Float, "
        f"TensorDeviceTypes={_OPTIONS})"
    )


# What rank 1 raised on torch 2.13.0 with gloo when it skipped an all_reduce its peer ran (captured by experiment).
TORCH_2_13 = (
    "Detected mismatch between collectives on ranks. Rank 1 is running collective: "
    f"{fingerprint(2, 'ALLREDUCE', '[3]')}, but Rank 0 is running collective: {fingerprint(2, 'ALLREDUCE', '[4]')}"
    ".Collectives differ in the following aspects: \t Tensor Tensor shapes: 3vs 4"
)
OP_TYPES = (
    "Detected mismatch between collectives on ranks. Rank 0 is running collective: "
    f"{fingerprint(7, 'BROADCAST', '[5]')}, but Rank 1 is running collective: {fingerprint(7, 'ALLREDUCE', '[1]')}"
    ".Collectives differ in the following aspects: \t Op type: BROADCASTvs ALLREDUCE  Tensor Tensor shapes: 5vs 1"
)
NO_SEQUENCE = (  # older torch: no sequence number in the fingerprint, nothing after it
    "Detected mismatch between collectives on ranks. Rank 3 is running collective: "
    "CollectiveFingerPrint(OpType=BARRIER), but Rank 2 is running collective: "
    "CollectiveFingerPrint(OpType=ALLGATHER, TensorShape=[2, 8], TensorDtypes=Half, TensorDeviceTypes=cuda)"
)


@pytest.mark.parametrize(
    ("text", "calls", "differences"),
    [
        (TORCH_2_13, [(1, "ALLREDUCE", "[3]", 2), (0, "ALLREDUCE", "[4]", 2)], "Tensor Tensor shapes: 3vs 4"),
        (OP_TYPES, [(0, "BROADCAST", "[5]", 7), (1, "ALLREDUCE", "[1]", 7)], "Op type: BROADCASTvs ALLREDUCE"),
        (NO_SEQUENCE, [(3, "BARRIER", "", None), (2, "ALLGATHER", "[2, 8]", None)], ""),
    ],
    ids=["torch-2.13-shapes", "op-types", "older-torch-no-sequence"],
)
def test_the_mismatch_names_each_rank_its_operation_and_the_difference(text, calls, differences):
    desync = failures.parse_desync(text)
    assert desync is not None
    assert [(c.rank, c.op, c.shapes, c.sequence) for c in desync.calls] == calls
    assert desync.differences.startswith(differences)
    message = desync.message()
    assert message.startswith(conditions.DESYNC_MARKER) and "\n" not in message
    for rank, op, _, _ in calls:
        assert f"rank {rank} called {op}" in message


def test_the_message_reads_as_one_sentence_per_rank():
    message = failures.parse_desync(OP_TYPES).message()
    assert message.startswith(
        "collective desync: rank 0 called BROADCAST (tensor shape [5], float, collective #7) while rank 1 called "
        "ALLREDUCE (tensor shape [1], float, collective #7); they differ in Op type: BROADCASTvs ALLREDUCE"
    )
    assert "a restart would repeat it" in message


def test_a_desync_is_found_through_the_exceptions_it_was_raised_from():
    try:
        try:
            raise RuntimeError(TORCH_2_13)
        except RuntimeError as inner:
            raise ValueError("the user's wrapper") from inner
    except ValueError as outer:
        found = failures.find_desync(outer)
    assert found is not None and found.ranks == (1, 0)


@pytest.mark.parametrize(
    "text", ["Connection closed by peer [127.0.0.1]:1", "shape mismatch", ""], ids=["gloo", "user-bug", "empty"]
)
def test_anything_else_is_no_desync(text):
    assert failures.find_desync(RuntimeError(text)) is None


def test_a_desync_is_never_a_failed_collective_even_when_it_mentions_gloo():
    # A re-formed group would repeat the mismatch: counting it as a peer failure would loop.
    text = TORCH_2_13 + " [gloo/transport/tcp/pair.cc]"
    assert not failures.is_collective_failure(RuntimeError(text))
    assert failures.is_collective_failure(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer"))


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ("collective desync: rank 1 called ALLREDUCE while rank 0 called BROADCAST", Reason.COLLECTIVE_DESYNC),
        (
            "worker rank 0 failed with exit code 85: CollectiveDesyncError: collective desync: rank 1 called X",
            Reason.COLLECTIVE_DESYNC,
        ),
        ("the dataset changed", Reason.PERMANENT_EXIT_CODE),
        ("", Reason.PERMANENT_EXIT_CODE),
    ],
    ids=["trainer-report", "termination-message", "other-permanent", "no-message"],
)
def test_the_failed_reason_follows_the_trainers_message(message, reason):
    assert conditions.failure_reason(message) is reason
