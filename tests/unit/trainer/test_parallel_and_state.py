"""Single-process pieces of FSDP2 support: which modules are sharded by default, the checkpointed RNG states."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from disttrain.trainer import data, parallel
from disttrain.trainer.checkpoint.manager import TrainerState


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Dropout(0.1)])
        self.head = nn.Linear(4, 10)


class Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.act = nn.Tanh()
        self.l2 = nn.Linear(4, 1)


def test_the_default_shards_each_block_of_a_module_list_and_leaves_the_rest_to_the_root():
    model = Blocks()
    assert parallel.default_shard_modules(model) == [model.blocks[0], model.blocks[1]]


def test_without_a_module_list_the_default_shards_each_child_with_parameters():
    model = Flat()
    assert parallel.default_shard_modules(model) == [model.l1, model.l2]


@pytest.mark.parametrize(
    "value, expected",
    [("ddp", parallel.Parallelism.DDP), ("fsdp2", parallel.Parallelism.FSDP2)],
    ids=["ddp", "fsdp2"],
)
def test_parallelism_names_parse(value, expected):
    assert parallel.Parallelism(value) is expected


def test_the_trainer_state_restores_the_numpy_python_and_torch_rngs():
    state = TrainerState(step=3)
    saved = state.state_dict()
    expected = (np.random.rand(), random.random(), torch.rand(1).item())
    np.random.rand(5), random.random(), torch.rand(3)  # move every stream on
    restored = TrainerState()
    restored.load_state_dict(saved)
    assert restored.step == 3
    assert (np.random.rand(), random.random(), torch.rand(1).item()) == expected


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(3))


def test_an_iterable_dataset_without_seek_is_refused_naming_the_protocol():
    with pytest.raises(TypeError, match=r"Stream is an IterableDataset without __len__ and seek;.*SeekableStream"):
        data.random_access(Stream())


def test_an_object_without_random_access_is_refused_saying_what_the_trainer_needs():
    with pytest.raises(TypeError, match="list_iterator has no random access; the trainer needs a map-style"):
        data.random_access(iter([1, 2]))


class CountingStream(torch.utils.data.IterableDataset):
    """Samples 100 + i; counts how many samples it produced (a seek is cheap, reading is what costs)."""

    def __init__(self, n: int) -> None:
        self.n, self.start, self.produced = n, 0, 0

    def __len__(self) -> int:
        return self.n

    def seek(self, index: int) -> None:
        self.start = index

    def __iter__(self):
        for i in range(self.start, self.n):
            self.produced += 1
            yield 100 + i


def test_a_seekable_stream_serves_any_order_and_consecutive_runs_cost_one_seek():
    stream = CountingStream(10)
    readable = data.random_access(stream)
    assert isinstance(readable, data.SeekingDataset) and len(readable) == 10
    assert readable.__getitems__([3, 4, 5, 9, 0, 1]) == [103, 104, 105, 109, 100, 101]
    assert readable.seeks == 3 and stream.produced == 6, "a run reads on, it does not seek again"
    assert readable[2] == 102 and readable.seeks == 3, "index 2 follows index 1"
    assert readable[7] == 107 and readable.seeks == 4


class ShortStream(CountingStream):
    """Claims 10 samples, holds 5."""

    def __iter__(self):
        return (100 + i for i in range(self.start, 5))


def test_a_stream_shorter_than_its_len_fails_naming_the_sample():
    readable = data.random_access(ShortStream(10))
    with pytest.raises(IndexError, match="ShortStream ended before sample 7 although its len\\(\\) is 10"):
        readable[7]


def test_a_seeking_dataset_pickles_without_its_open_iterator():
    import pickle

    readable = data.random_access(CountingStream(4))
    readable[0]
    clone = pickle.loads(pickle.dumps(readable))
    assert clone[1] == 101 and clone.seeks == 2


def test_a_tensor_dataset_passes_through_unchanged():
    dataset = torch.utils.data.TensorDataset(torch.zeros(3))
    assert data.random_access(dataset) is dataset


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_step_failed_mid_forward_still_lets_the_optimizer_move_onto_a_new_sharding(one_process_group):
    """A failure in the middle of FSDP2's forward leaves unsharded parameters registered on the modules; the names the
    optimizer is pointed at again come from when the model was sharded, so leaving and re-sharding still work."""
    from disttrain.trainer import mesh as mesh_mod
    from disttrain.trainer.options import ParallelOptions

    model = Stack()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    template = parallel.ModelTemplate(model)
    cpu, fp32 = torch.device("cpu"), parallel.Precision.FP32
    wrapped = parallel.wrap(model, optimizer, cpu, ParallelOptions(parallelism=parallel.Parallelism.FSDP2), fp32)

    def fail(*_args: object) -> None:
        raise RuntimeError("a peer is gone")

    model.blocks[1].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="a peer is gone"):
        model(torch.ones(2, 4))
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert any(id(p) not in held for p in model.parameters()), "the failed forward left unsharded parameters"

    layout = wrapped.optimizer_layout
    parallel.release(optimizer)
    layout_1 = mesh_mod.Layout(mesh_mod.MeshKind.FLAT, 1, 1)
    again = parallel.rewrap(template, layout, optimizer, cpu, parallel.Sharding(fp32, layout_1))
    names = {id(p): name for name, p in again.module.named_parameters()}
    assert [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups] == [
        [name for name, _ in Stack().named_parameters()]
    ]
