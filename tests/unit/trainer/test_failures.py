"""Which exceptions count as a failed collective (exit REFORM) and which are bugs (exit 1)."""

import pytest
import torch.distributed as dist

from disttrain.trainer.failures import is_collective_failure

# Messages gloo raised in a survivor on torch 2.13.0 (tests/trainer/test_collective_failures.py reproduces them).
GLOO_PEER_DIED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
    "peer [127.0.0.1]:20866. This is typically caused by a remote worker crashing."
)
GLOO_PEER_HUNG = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
    "waiting 4000ms for recv operation to complete"
)


@pytest.mark.parametrize(
    "exc",
    [
        dist.DistError("x"),
        dist.DistBackendError("NCCL error"),
        dist.DistNetworkError("x"),
        dist.DistStoreError("x"),
        RuntimeError(GLOO_PEER_DIED),
        RuntimeError(GLOO_PEER_HUNG),
        RuntimeError("Application timeout caused pair closure"),  # an all_reduce past the timeout, 2.13.0
    ],
    ids=[
        "DistError",
        "DistBackendError",
        "DistNetworkError",
        "DistStoreError",
        "gloo-peer-died",
        "gloo-peer-hung",
        "gloo-pair-closed-on-timeout",
    ],
)
def test_a_failed_collective_is_recognised(exc):
    assert is_collective_failure(exc)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x1)"),
        ValueError("Connection closed by peer"),  # only RuntimeError carries gloo's errors
        KeyError("gloo"),
    ],
    ids=["shape-bug", "not-a-runtime-error", "key-error"],
)
def test_other_errors_are_not_a_failed_collective(exc):
    assert not is_collective_failure(exc)
