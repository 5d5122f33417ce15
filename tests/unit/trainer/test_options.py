"""The trainer's options: a script's keyword arguments map onto one frozen record, every value is checked once, and
an invalid one is refused naming the option, the value and what is allowed."""

from __future__ import annotations

import dataclasses

import pytest
from torch.utils.data import default_collate

from disttrain.api.contract import WorkerContract
from disttrain.trainer.options import OptionError, TrainerOptions
from disttrain.trainer.parallel import Parallelism, Precision


def contract(reform_in_place: bool = False) -> WorkerContract:
    return WorkerContract.model_validate(
        {
            "training": {"globalBatchSize": 4, "microBatchSize": 1, "lr": {"base": 0.1}, "maxSteps": 2},
            "checkpoint": {"path": "/tmp/unused"},
            "reform_in_place": reform_in_place,
        }
    )


def test_no_keyword_arguments_give_the_documented_defaults():
    options = TrainerOptions.from_env(contract())
    assert options.parallel.parallelism is Parallelism.DDP
    assert options.parallel.device == "auto"
    assert options.precision.precision is Precision.FP32
    assert options.precision.clip_grad_norm is None
    assert options.data.collate_fn is default_collate
    assert options.data.num_workers == 0
    assert dict(options.checkpoint.user_state) == {}
    assert options.log_every == 10
    assert options.lifecycle.reform_in_place is False


def test_every_keyword_argument_lands_in_its_section():
    counter, hook, scaler = object(), lambda phase, step: None, object()
    options = TrainerOptions.from_env(
        contract(),
        parallelism="fsdp2",
        precision="bf16",
        clip_grad_norm=1.0,
        grad_scaler=scaler,  # type: ignore[typeddict-item]
        num_workers=2,
        prefetch_factor=3,
        user_state={"counter": counter},  # type: ignore[dict-item]
        on_checkpoint_phase=hook,
        log_every=5,
        device="cpu",
    )
    assert options.parallel.parallelism is Parallelism.FSDP2 and options.parallel.device == "cpu"
    assert options.precision.precision is Precision.BF16 and options.precision.clip_grad_norm == 1.0
    assert options.precision.grad_scaler is scaler
    assert (options.data.num_workers, options.data.prefetch_factor) == (2, 3)
    assert options.checkpoint.user_state["counter"] is counter and options.checkpoint.on_phase is hook
    assert options.log_every == 5


@pytest.mark.parametrize(
    ("reform_in_place", "parallelism", "expected"),
    [(True, "ddp", True), (True, "fsdp2", True), (False, "ddp", False), (False, "fsdp2", False)],
    ids=["asked-under-ddp", "asked-under-fsdp2", "not-asked", "not-asked-under-fsdp2"],
)
def test_reforms_are_in_place_when_the_contract_asks_whatever_the_parallelism(reform_in_place, parallelism, expected):
    options = TrainerOptions.from_env(contract(reform_in_place), parallelism=parallelism)
    assert options.lifecycle.reform_in_place is expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"parallelism": "tp"}, "parallelism='tp' is not supported; allowed: 'ddp', 'fsdp2'"),
        ({"precision": "fp8"}, "precision='fp8' is not supported; allowed: 'fp32', 'bf16', 'fp16'"),
        ({"num_workers": -1}, "num_workers=-1 must be >= 0"),
        ({"clip_grad_norm": 0.0}, "clip_grad_norm=0.0 must be a positive number"),
        ({"device": "gpu"}, "device='gpu' is not supported; allowed: 'auto', 'cuda', 'cpu'"),
    ],
    ids=["parallelism", "precision", "num-workers", "clip", "device"],
)
def test_an_invalid_value_is_refused_naming_the_option_the_value_and_what_is_allowed(kwargs, message):
    with pytest.raises(OptionError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        TrainerOptions.from_env(contract(), **kwargs)


def test_an_unknown_option_is_a_type_error_as_a_misspelt_keyword_argument_is():
    with pytest.raises(TypeError, match="num_worker"):
        TrainerOptions.from_env(contract(), num_worker=2)  # type: ignore[call-arg]


def test_the_options_are_frozen():
    options = TrainerOptions.from_env(contract())
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.data.num_workers = 3  # type: ignore[misc]
