"""This rank's items of a state dict, as DCP's save planner sees them, copied to host memory.

The items and their keys are DCP's own (``DefaultSavePlanner``'s local plan over the flattened state dict), so what
is captured here loads back through ``dcp.load`` exactly as a checkpoint would, resharded by DCP's load planner onto
any new mesh. A capture copies each tensor chunk into a host buffer that is reused from one capture to the next (one
allocation per item and slot, at the group's first capture).

Callers: :class:`disttrain.trainer.replicas.keeper.ReplicaKeeper`.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.stateful import Stateful

from disttrain.trainer.replicas.catalogue import ItemKey, ItemSpec

Value = Union[torch.Tensor, bytes]
"""A captured item: a host tensor (one chunk) or a non-tensor value as ``torch.save`` bytes."""


def state_dict_of(contents: Mapping[str, Any]) -> dict[str, Any]:
    """``contents`` (name -> Stateful or value) as the nested state dict DCP saves."""
    return {name: value.state_dict() if isinstance(value, Stateful) else value for name, value in contents.items()}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype an :class:`ItemSpec` names (refuses anything that is not a dtype)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def _spec(item: WriteItem) -> ItemSpec:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return ItemSpec(item.index.fqn, (), (), (), "bytes")
    chunk = item.tensor_data.chunk
    return ItemSpec(
        item.index.fqn,
        tuple(int(x) for x in chunk.offsets),
        tuple(int(x) for x in chunk.sizes),
        tuple(int(x) for x in item.tensor_data.size),
        _dtype_name(item.tensor_data.properties.dtype),
    )


def capture(
    state_dict: dict[str, Any], into: Optional[dict[ItemKey, Value]] = None
) -> tuple[list[ItemSpec], dict[ItemKey, Value]]:
    """This rank's items of ``state_dict`` and a host copy of each, written into the buffers of ``into`` where their
    shapes match (a previous capture of the same layout) and into new ones otherwise."""
    specs, values, _ = _capture(state_dict, into)
    return specs, values


class Capturer:
    """Captures of one group's state, step after step, at the cost of the copies alone for its large part.

    The model and optimizer state (``steady``) keep their tensors from one step to the next (parameters and optimizer
    state are updated in place), so after the first capture their items are copied straight from the views DCP's
    planner resolved then, without a new state dict or plan; their non-tensor values (the param groups'
    hyperparameters) are kept from the first capture too (the LR is recomputed from the rule at every resume). The
    rest (the trainer's counters and RNG states, a scheduler, a scaler, the user's state) is small and captured anew
    each time."""

    def __init__(self) -> None:
        self._views: Optional[list[tuple[ItemKey, torch.Tensor]]] = None
        self._steady_bytes: dict[ItemKey, Value] = {}
        self._steady_specs: list[ItemSpec] = []

    def capture(
        self,
        steady: Callable[[], dict[str, Any]],
        rest: dict[str, Any],
        into: Optional[dict[ItemKey, Value]] = None,
    ) -> tuple[list[ItemSpec], dict[ItemKey, Value]]:
        """This rank's items of the state dicts ``steady()`` (called at the first capture only) and ``rest``, copied
        into ``into``'s buffers where they fit."""
        if self._views is None:
            self._steady_specs, first, self._views = _capture(steady(), into)
            self._steady_bytes = {k: v for k, v in first.items() if isinstance(v, bytes)}
            values = dict(first)
        else:
            values = dict(self._steady_bytes)
            for key, view in self._views:
                values[key] = _copy_into(view, into.get(key) if into is not None else None)
        specs, changing, _ = _capture(rest, into)
        values.update(changing)
        return [*self._steady_specs, *specs], values


def _copy_into(source: torch.Tensor, old: Optional[Value]) -> torch.Tensor:
    if isinstance(old, torch.Tensor) and old.shape == source.shape and old.dtype == source.dtype:
        old.copy_(source)
        return old
    return source.to("cpu", copy=True).contiguous()


def _capture(
    state_dict: dict[str, Any], into: Optional[dict[ItemKey, Value]]
) -> tuple[list[ItemSpec], dict[ItemKey, Value], list[tuple[ItemKey, torch.Tensor]]]:
    planner = DefaultSavePlanner(flatten_state_dict=True, flatten_sharded_tensors=True)
    planner.set_up_planner(state_dict, is_coordinator=True)
    plan = planner.create_local_plan()
    specs: list[ItemSpec] = []
    values: dict[ItemKey, Value] = {}
    views: list[tuple[ItemKey, torch.Tensor]] = []
    for item in plan.items:
        spec = _spec(item)
        data = planner.resolve_data(item)
        if isinstance(data, io.BytesIO):
            values[spec.key] = data.getvalue()
        else:
            view = data.detach()
            views.append((spec.key, view))
            values[spec.key] = _copy_into(view, into.get(spec.key) if into is not None else None)
        specs.append(spec)
    return specs, values, views


def as_bytes(value: torch.Tensor) -> torch.Tensor:
    """A host tensor's bytes as a flat uint8 tensor (a view when it is contiguous)."""
    flat = value.contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def from_bytes(raw: torch.Tensor, spec: ItemSpec) -> torch.Tensor:
    """The tensor chunk ``spec`` describes, read from its bytes (a copy, so ``raw`` may be reused)."""
    dtype = dtype_of(spec.dtype)
    if raw.numel() == 0:
        return torch.empty(spec.sizes, dtype=dtype)
    return raw.clone().view(dtype).reshape(spec.sizes)


def nbytes(spec: ItemSpec) -> int:
    """The bytes of a tensor item's chunk."""
    count = 1
    for size in spec.sizes:
        count *= size
    return count * torch.empty((), dtype=dtype_of(spec.dtype)).element_size()
