"""Single-process pieces of FSDP2 support: which modules are sharded by default, the checkpointed RNG states."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from disttrain.trainer import data, parallel
from disttrain.trainer.checkpoint import TrainerState


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


def test_an_iterable_dataset_is_refused_saying_what_the_trainer_needs():
    with pytest.raises(TypeError, match="Stream has no random access; the trainer needs a map-style dataset"):
        data.check_random_access(Stream())


def test_a_tensor_dataset_has_random_access():
    data.check_random_access(torch.utils.data.TensorDataset(torch.zeros(3)))
