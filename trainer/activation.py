"""Activation checkpointing: chosen modules keep only their inputs for the backward and recompute the rest there.

Called once by :meth:`disttrain.trainer.loop.ElasticTrainer.from_env` (option ``activation_checkpointing``), on the
model before or after DDP/FSDP2 wrapping alike. Each chosen module's ``forward`` is run through torch's
non-reentrant :func:`torch.utils.checkpoint.checkpoint` (the implementation ``checkpoint_wrapper`` uses), set on the
instance instead of wrapping the module in another one. Why: the module tree stays the model's own, so parameter
names, state-dict keys, an FSDP2 ``shard_modules`` list and a tensor-parallel plan's module names are unchanged (a
``CheckpointWrapper`` adds ``_checkpoint_wrapped_module.`` to every name below it), and a checkpoint written with
checkpointing loads without it. FSDP2's and DDP's hooks stay on the module's call, outside the recomputed region,
as with ``checkpoint_wrapper``.

Exactness: the recomputation restores the RNG and autocast state of the forward, so gradients are bitwise those
of the run without checkpointing (``tests/unit/trainer/test_activation_checkpointing.py``). Cost: one more forward
of each chosen module per backward (``bench/activation_memory.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch.utils.checkpoint
from torch import nn

Target = Union[type[nn.Module], Sequence[type[nn.Module]], Callable[[nn.Module], bool]]
"""Which modules are checkpointed: a module class, several, or a predicate on a module (never the root)."""


def check(target: object) -> Optional[str]:
    """Why ``target`` is not a :data:`Target` (None when it is, or is None: no checkpointing)."""
    if target is None or _is_module_class(target):
        return None
    if isinstance(target, Sequence) and not isinstance(target, (str, bytes)):
        if target and all(_is_module_class(t) for t in target):
            return None
        return "a sequence must hold nn.Module subclasses (at least one)"
    if callable(target):
        return None
    return "expected an nn.Module subclass, a sequence of them, or a predicate module -> bool"


def apply(model: nn.Module, target: Optional[Target]) -> list[nn.Module]:
    """Checkpoint the activations of every submodule of ``model`` that ``target`` selects (the root never: it would
    keep nothing); returns them. Idempotent: a module already checkpointed is left as it is. Raises ``ValueError``
    when ``target`` selects nothing, so a misspelt class is not silently a no-op."""
    if target is None:
        return []
    selects = _predicate(target)
    chosen = [m for m in model.modules() if m is not model and selects(m)]
    if not chosen:
        raise ValueError(f"activation_checkpointing={target!r} selects no submodule of {type(model).__name__}")
    for module in chosen:
        if not is_checkpointed(module):
            # A partial of the module, not a closure over its bound method: deepcopy and pickle rebind it to the copy.
            module.forward = functools.partial(_checkpointed_forward, module)
    return chosen


def is_checkpointed(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _checkpointed_forward


def _checkpointed_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The class's forward of ``module``, its activations recomputed in the backward (RNG state preserved)."""
    return torch.utils.checkpoint.checkpoint(type(module).forward, module, *args, use_reentrant=False, **kwargs)


def _is_module_class(value: object) -> bool:
    return isinstance(value, type) and issubclass(value, nn.Module)


def _predicate(target: Target) -> Callable[[nn.Module], bool]:
    if _is_module_class(target):
        kinds: tuple[type[nn.Module], ...] = (target,)  # type: ignore[assignment]
        return lambda m: isinstance(m, kinds)
    if isinstance(target, Sequence):
        kinds = tuple(target)
        return lambda m: isinstance(m, kinds)
    return target  # type: ignore[return-value]
