"""Activation checkpointing keeps the step exact: the same gradients bitwise (dropout included), the same state-dict
keys (a checkpoint written with it loads without it), and it really keeps fewer activations for the backward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from disttrain.trainer import activation
from disttrain.trainer.options import OptionError, ParallelOptions

pytestmark = pytest.mark.unit


class Block(nn.Module):
    """A pre-norm MLP block with dropout: its recomputation must replay the same dropout mask."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(7)  # the dropout masks
    loss = model(x).pow(2).sum()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes the autograd graph saves for the backward outside checkpointed regions."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum().backward()
    return total


def test_gradients_are_bitwise_those_without_checkpointing_dropout_included():
    torch.manual_seed(0)
    plain = Net()
    checkpointed = copy.deepcopy(plain)
    assert len(activation.apply(checkpointed, Block)) == 3
    x = torch.randn(5, 8)
    loss_plain, grads_plain = _grads(plain, x)
    loss_ckpt, grads_ckpt = _grads(checkpointed, x)
    assert torch.equal(loss_plain, loss_ckpt)
    assert grads_plain.keys() == grads_ckpt.keys()
    assert all(torch.equal(grads_plain[k], grads_ckpt[k]) for k in grads_plain)


def test_it_keeps_fewer_activations_for_the_backward():
    torch.manual_seed(0)
    plain = Net(width=64)
    checkpointed = copy.deepcopy(plain)
    activation.apply(checkpointed, lambda m: isinstance(m, Block))
    x = torch.randn(32, 8)
    assert _saved_bytes(checkpointed, x) < 0.25 * _saved_bytes(plain, x)


def test_state_dict_keys_are_unchanged_and_a_checkpoint_loads_into_the_plain_model():
    torch.manual_seed(0)
    checkpointed = Net()
    activation.apply(checkpointed, [Block])
    plain = Net()
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    assert list(get_model_state_dict(checkpointed)) == list(get_model_state_dict(plain))
    plain.load_state_dict(checkpointed.state_dict())
    assert all(
        torch.equal(a, b) for a, b in zip(plain.state_dict().values(), checkpointed.state_dict().values(), strict=True)
    )


def test_a_deep_copy_runs_its_own_weights_not_the_original_s():
    torch.manual_seed(0)
    model = Net()
    activation.apply(model, Block)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(1.0)
    x = torch.randn(2, 8)
    model.eval(), twin.eval()
    assert activation.is_checkpointed(twin.blocks[0])
    assert not torch.equal(model(x), twin(x))


def test_applying_twice_is_once_and_a_target_that_selects_nothing_is_refused():
    model = Net()
    first = activation.apply(model, Block)
    forwards = [b.forward for b in first]
    activation.apply(model, Block)
    assert [b.forward for b in model.blocks] == forwards
    with pytest.raises(ValueError, match="selects no submodule"):
        activation.apply(model, nn.Conv2d)


@pytest.mark.parametrize(
    "value",
    [pytest.param("blocks", id="a string"), pytest.param([], id="empty"), pytest.param([int], id="not a module")],
)
def test_an_invalid_option_names_itself(value):
    with pytest.raises(OptionError, match="activation_checkpointing="):
        ParallelOptions(activation_checkpointing=value)
