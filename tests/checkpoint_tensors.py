"""Read every tensor of a committed checkpoint (``step-N/``) into a plain dict, in the test process, without a group.

Tests compare what runs ended with bit for bit (``torch.equal``): the model parameters (``app.model.*``) and the
optimizer state (``app.optim.*``) as the trainer committed them.
"""

from __future__ import annotations

import pathlib
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from disttrain.trainer.checkpoint import storage


def load_tensors(step_dir: pathlib.Path, prefix: str = "app.") -> dict[str, torch.Tensor]:
    """Every tensor whose key starts with ``prefix``, read with the trainer's own storage reader."""
    reader = storage.CheckpointReader(str(step_dir))
    metadata = reader.read_metadata()
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "torch.distributed is ... uninitialized": that is the point
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """Keys whose tensors are not bitwise equal, with the largest absolute difference (inf for a missing key)."""
    out = {}
    for key in sorted(a.keys() | b.keys()):
        if key not in a or key not in b:
            out[key] = float("inf")
        elif not torch.equal(a[key], b[key]):
            out[key] = float((a[key].double() - b[key].double()).abs().max())
    return out


def assert_readable_by_dcp(step_dir: pathlib.Path, out: pathlib.Path) -> dict:
    """Convert ``step_dir`` with DCP's own ``dcp_to_torch_save`` (its stock reader, not the trainer's) and check
    that every tensor equals what the trainer's reader gets; returns the converted (nested) state dict."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp_to_torch_save(step_dir, out)
    converted = torch.load(out, weights_only=False)  # written just above by DCP, from the checkpoint's pickles
    flat, _ = flatten_state_dict(converted)  # DCP's own keys: "app.model.0.weight"
    ours = load_tensors(step_dir, prefix="")
    assert ours and ours.keys() <= flat.keys()
    for key, value in ours.items():
        assert torch.equal(flat[key], value), key
    return converted
