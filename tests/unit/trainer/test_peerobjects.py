"""What a rank accepts from its peers' object collectives: the trainer's and DCP's plain data, never code."""

from __future__ import annotations

import errno
import io
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.distributed_c10d as c10d
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.tensor import Replicate, Shard

from disttrain.trainer import peerobjects

pytestmark = pytest.mark.unit


def _decode(data: bytes) -> object:
    return peerobjects.PeerUnpickler(io.BytesIO(data)).load()


def _dcp_objects() -> list[object]:
    """What DCP's save and load planning gather and scatter, from a real planner over a mixed state dict."""
    state = {"w": torch.randn(3, 4), "step": 5, "name": "x", "extra": {"a": [1, 2.0, None]}, "b": io.BytesIO(b"z")}
    saver = DefaultSavePlanner()
    saver.set_up_planner(state, is_coordinator=True)
    local = saver.create_local_plan()
    plans, metadata = saver.create_global_plan([local])
    loader = DefaultLoadPlanner()
    loader.set_up_planner({"w": torch.zeros(3, 4)}, metadata, is_coordinator=True)
    return [plans, metadata, loader.create_local_plan()]


PLAIN = [
    torch.arange(6).reshape(2, 3),
    torch.float16,
    torch.strided,
    torch.Size([2, 3]),
    Shard(0),
    Replicate(),
    {1, 2},
    frozenset({"a"}),
    (1, "a", b"b", 2.5, None, True),
    [("x", 3)],
    Path("step-5/__0_0.distcp"),
    {"problems": [None, "rank 1: disk full"]},
]


def _failure() -> object:
    """What DCP gathers from a rank whose write failed: the exception and its traceback summary."""
    try:
        raise OSError(errno.ENOSPC, "No space left on device", "step-3/__0_0.distcp")
    except OSError as exc:
        return CheckpointException("write", {0: _wrap_exception(exc)})


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_a_ranks_failure_reaches_its_peers_as_the_error_it_was(protocol):
    received = _decode(pickle.dumps(_failure(), protocol=protocol))
    assert isinstance(received, CheckpointException)
    error, summary = received.failures[0]
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC
    assert summary[-1].name == "_failure"


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_the_trainers_and_dcps_objects_decode_as_they_were_sent(protocol):
    for sent in [*PLAIN, *_dcp_objects()]:
        received = _decode(pickle.dumps(sent, protocol=protocol))
        assert type(received) is type(sent)
        if isinstance(sent, torch.Tensor):
            assert torch.equal(received, sent)  # type: ignore[arg-type]
        elif not isinstance(sent, (list, io.BytesIO)) and type(sent).__module__ == "builtins":
            assert received == sent


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, (f"touch {self.marker}",))


class _Opens:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (open, (str(self.marker), "a"))


def test_a_pickle_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    for evil in (_RunsCode(marker), _Opens(marker), [1, {"nested": _RunsCode(marker)}]):
        with pytest.raises(pickle.UnpicklingError, match="not plain data"):
            _decode(pickle.dumps(evil))
    assert not marker.exists()


class _Storage:
    def __init__(self, saved: bytes) -> None:
        self.saved = saved

    def __reduce__(self) -> tuple[object, ...]:
        return (torch.storage._load_from_bytes, (self.saved,))


def test_a_storage_cannot_smuggle_a_free_unpickle(tmp_path):
    """torch pickles a storage as its ``torch.save`` bytes, which torch itself reads with a free ``torch.load``."""
    marker = tmp_path / "pwned"
    saved = io.BytesIO()
    torch.save(_RunsCode(marker), saved)
    with pytest.raises(pickle.UnpicklingError):
        _decode(pickle.dumps(_Storage(saved.getvalue()), protocol=2))
    assert not marker.exists()


class _ByName:
    """An enum member as Python 3.12 (and later 3.11 releases) pickle it: ``getattr(cls, name)``."""

    def __init__(self, owner: object, name: str) -> None:
        self.owner, self.name = owner, name

    def __reduce__(self) -> tuple[object, ...]:
        return (getattr, (self.owner, self.name))


def test_an_enum_member_pickled_by_name_decodes_and_getattr_does_nothing_else(tmp_path):
    from torch.distributed.checkpoint.planner import WriteItemType

    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        assert _decode(pickle.dumps(_ByName(WriteItemType, "TENSOR"), protocol=protocol)) is WriteItemType.TENSOR
    for owner, name in [(torch.Size, "__init__"), (WriteItemType, "__class__"), (Path, "cwd")]:
        with pytest.raises(pickle.UnpicklingError, match="no enum member"):
            _decode(pickle.dumps(_ByName(owner, name)))


def test_a_builtin_callable_or_a_class_that_acts_is_refused():
    for module, name in [("builtins", "eval"), ("builtins", "setattr"), ("subprocess", "Popen"), ("torch", "load")]:
        with pytest.raises(pickle.UnpicklingError, match=f"{module}.{name}"):
            peerobjects.allowed_global(module, name)
    with pytest.raises(pickle.UnpicklingError):  # an exception of a module nobody imported: finding it would import it
        peerobjects.allowed_global("antigravity", "Error")
    with pytest.raises(pickle.UnpicklingError):  # a DCP class that is no plain data: its constructor writes files
        peerobjects.allowed_global("torch.distributed.checkpoint.filesystem", "FileSystemWriter")


def test_install_puts_the_decoder_where_torchs_object_collectives_take_it(monkeypatch):
    monkeypatch.setattr(c10d, "_unpickler", pickle.Unpickler)
    peerobjects.install()
    tensor, size = c10d._object_to_tensor({"step": 7}, torch.device("cpu"), None)
    assert c10d._tensor_to_object(tensor, size, None) == {"step": 7}
    evil, evil_size = c10d._object_to_tensor(_Opens(Path("/nonexistent/x")), torch.device("cpu"), None)
    with pytest.raises(pickle.UnpicklingError):
        c10d._tensor_to_object(evil, evil_size, None)
