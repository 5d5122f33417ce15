"""What happens to gradients between the last backward and ``optimizer.step()``: fp16 loss scaling and clipping.

Used by :class:`disttrain.trainer.loop.ElasticTrainer` in its optimizer step. Two rules keep every rank in
step whatever the parallelism:

- the fp16 GradScaler agrees on overflow across ranks (``ShardedGradScaler`` all-reduces its found-inf flag:
  under FSDP2 each rank sees only its shard of the gradient, so one rank's inf must skip the step everywhere);
- the clipping norm is the norm of the *global* gradient, computed after accumulation on synchronised
  gradients (DTensors under FSDP2, whose norm is reduced over the shards).

The scaler's state (scale, growth tracker) is checkpointed through :class:`GradScalerState`, so a resume at any
world size continues with the same scale.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from disttrain.trainer.parallel import Precision


class PrecisionState:
    """The loss scaler of this run (fp16 only; ``None`` otherwise) and the calls the loop makes on it."""

    def __init__(self, precision: Precision, device: torch.device, scaler: Optional[ShardedGradScaler] = None) -> None:
        if scaler is not None and precision is not Precision.FP16:
            raise ValueError(f"grad_scaler is only used with precision='fp16', not {precision.value!r}")
        if scaler is None and precision is Precision.FP16:
            scaler = ShardedGradScaler(device=device.type)
        self.precision = precision
        self.scaler = scaler

    def scaler_record(self) -> dict[str, Any]:
        """The scaler's scale and growth tracker, for logs and tests (empty without a scaler)."""
        if self.scaler is None:
            return {}
        state = self.scaler.state_dict()
        return {"scale": state.get("scale"), "growth_tracker": state.get("_growth_tracker")}

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Turn the scaled gradients back into true ones (before clipping reads them)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``, skipped on every rank when any rank's fp16 gradient overflowed."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()


class GradScalerState(Stateful):
    """The GradScaler's scale and growth tracker as plain global values (the same on every rank)."""

    def __init__(self, scaler: ShardedGradScaler) -> None:
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        return dict(self.scaler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scaler.load_state_dict(dict(state_dict))


def clip_global_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients of ``model`` to a global norm of ``max_norm``; returns the norm before clipping, as a
    (detached, plain) tensor on the gradients' device, so the caller decides when to wait for its value.

    Under FSDP2 the gradients are DTensor shards and their norm is a partial DTensor; ``full_tensor()`` is the
    all-reduce that makes it the norm of the whole gradient, the same on every rank, before any gradient is
    scaled by it (as TorchTitan does).
    """
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for p in model.parameters():  # an FSDP x TP model holds gradients on two meshes, which one op cannot mix
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    groups = list(by_mesh.values()) or [[]]
    norms = [_full_norm([p.grad for p in group if p.grad is not None]) for group in groups]
    norm = norms[0] if len(norms) == 1 else torch.nn.utils.get_total_norm(norms, norm_type=2.0)
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm.detach()


def _full_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of gradients on one mesh, reduced over its shards (a plain tensor)."""
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
