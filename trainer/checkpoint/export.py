"""``disttrain export``: a committed checkpoint's model weights, unsharded, as safetensors files.

    python -m disttrain.trainer.checkpoint.export CHECKPOINT OUT [--max-shard-bytes N]
        [--endpoint-url URL] [--region R] [--addressing-style auto|path|virtual]

CHECKPOINT is a checkpoint root (its newest valid checkpoint is taken, as resume would) or one ``step-N``
directory, which must validate (every file's size and digest, :func:`disttrain.trainer.checkpoint.commit.validate`),
or ``s3://bucket/prefix``: the newest checkpoint there whose objects all check out is downloaded into a temporary
directory (every byte verified, :mod:`disttrain.trainer.checkpoint.objectstore`), with boto3's credential chain
(environment, web identity, instance role) and the endpoint options for S3-compatible stores.
OUT is a directory; it gets what Hugging Face loaders read: ``model.safetensors``, or, above ``--max-shard-bytes``,
``model-0000i-of-0000n.safetensors`` files and ``model.safetensors.index.json``. The keys are the model's own
(``state_dict()`` of the unwrapped model: DDP's and FSDP2's wrappers add nothing), whatever parallelism wrote the
checkpoint: DCP reassembles every sharded tensor. One shard's tensors are in memory at a time, so exporting a
model larger than this machine's memory needs only a shard's worth of it. Each file's metadata records the step,
the job and the checkpoint's ``.metadata`` hash.

Exit status: 0 written, 2 no valid checkpoint or an unusable argument.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from disttrain.api.manifest import CheckpointManifest
from disttrain.trainer.checkpoint import commit, storage

MODEL_PREFIX = "app.model."
"""Where the trainer's state dict keeps the model (:class:`disttrain.trainer.checkpoint.state.ModelOptimState`)."""
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""Hugging Face's default shard size."""
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class ExportError(ValueError):
    """No checkpoint to export, or nothing to export in it."""


def choose(checkpoint: Path) -> tuple[Path, CheckpointManifest]:
    """The checkpoint directory to export and its manifest: ``checkpoint`` itself when it holds a manifest,
    else the newest valid checkpoint under it."""
    if commit.read_manifest(checkpoint)[0] is not None or commit.STEP_DIR.match(checkpoint.name):
        v = commit.validate(checkpoint)
        if not v.ok or v.manifest is None:
            raise ExportError(f"{checkpoint}: not a valid checkpoint ({v.problem})")
        return checkpoint, v.manifest
    found = commit.find_latest(checkpoint, log=lambda msg: print(f"skipped: {msg}", file=sys.stderr))
    if found is None or found.manifest is None:
        raise ExportError(f"{checkpoint}: no valid checkpoint (a step-N directory with COMPLETE.json) under it")
    return found.path, found.manifest


def model_tensors(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    """The model's tensors (full sizes) by their key in the model's own state dict."""
    return {
        key[len(MODEL_PREFIX) :]: meta
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)
    }


def plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Keys in order, cut into consecutive groups of at most ``max_bytes`` (a larger tensor alone in its group)."""
    shards: list[list[str]] = []
    used = 0
    for key in sorted(sizes):
        if not shards or (used + sizes[key] > max_bytes and shards[-1]):
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += sizes[key]
    return shards


def _load(
    directory: Path, manifest: CheckpointManifest, wanted: dict[str, TensorStorageMetadata]
) -> Iterator[tuple[str, torch.Tensor]]:
    state = {MODEL_PREFIX + k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in wanted.items()}
    reader = storage.CheckpointReader(str(directory), expected_metadata_sha256=manifest.metadata_sha256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "torch.distributed is not initialized": no group is needed
        dcp.load(state, storage_reader=reader, no_dist=True)
    for key, tensor in state.items():
        yield key[len(MODEL_PREFIX) :], tensor


def export(checkpoint: Path, out: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[Path]:
    """Write the model's weights of ``checkpoint`` under ``out``; returns the files written."""
    from safetensors.torch import save_file

    directory, manifest = choose(checkpoint)
    metadata = storage.CheckpointReader(str(directory), manifest.metadata_sha256).read_metadata()
    tensors = model_tensors(metadata)
    if not tensors:
        raise ExportError(f"{directory}: holds no model weights (no '{MODEL_PREFIX}*' tensors)")
    sizes = {k: m.size.numel() * m.properties.dtype.itemsize for k, m in tensors.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    out.mkdir(parents=True, exist_ok=True)
    info = {"format": "pt", "step": str(manifest.step), "metadata_sha256": manifest.metadata_sha256}
    if manifest.job:
        info["job"] = manifest.job
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    written = []
    for name, keys in zip(names, shards, strict=True):
        loaded = dict(_load(directory, manifest, {k: tensors[k] for k in keys}))
        save_file(loaded, str(out / name), metadata=info)
        written.append(out / name)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(sizes.values()), **info},
            "weight_map": {k: name for name, keys in zip(names, shards, strict=True) for k in keys},
        }
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(out / INDEX_FILE)
    return written


def export_from_bucket(uri: str, out: Path, max_shard_bytes: int, client: Any) -> list[Path]:
    """Download the newest trusted checkpoint under ``uri`` into a temporary directory next to ``out`` and
    export it."""
    from botocore.exceptions import BotoCoreError, ClientError

    from disttrain.trainer.checkpoint import objectstore

    store = objectstore.ObjectStoreCommitter(client, objectstore.parse_uri(uri))  # reads only: claims no round
    out.mkdir(parents=True, exist_ok=True)
    try:
        found = store.find_latest()
        if found is None:
            raise ExportError(f"{uri}: no checkpoint whose objects all exist with their sizes and ETags")
        with tempfile.TemporaryDirectory(prefix=".disttrain-export-", dir=out) as tmp:
            return export(store.download(found, Path(tmp)), out, max_shard_bytes)
    except (BotoCoreError, ClientError) as exc:
        raise ExportError(f"{uri}: {exc}") from exc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="disttrain export",
        description="Write a committed checkpoint's model weights, unsharded, as safetensors files.",
    )
    parser.add_argument(
        "checkpoint", help="a checkpoint root (its newest valid checkpoint), a step-N, or s3://bucket/prefix"
    )
    parser.add_argument("out", type=Path, help="output directory")
    parser.add_argument(
        "--max-shard-bytes",
        type=int,
        default=DEFAULT_MAX_SHARD_BYTES,
        metavar="N",
        help="largest safetensors file before the weights are split (default %(default)s)",
    )
    s3 = parser.add_argument_group("s3:// checkpoints (credentials: boto3's chain, e.g. AWS_ACCESS_KEY_ID)")
    s3.add_argument("--endpoint-url", default=None, metavar="URL", help="an S3-compatible store's endpoint")
    s3.add_argument("--region", default=None)
    s3.add_argument("--addressing-style", choices=["auto", "path", "virtual"], default="auto")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_shard_bytes < 1:
        print("disttrain export: --max-shard-bytes must be at least 1", file=sys.stderr)
        return 2
    try:
        if args.checkpoint.startswith("s3://"):
            from disttrain.trainer.checkpoint.objectstore import make_client

            client = make_client(args.endpoint_url, args.region, args.addressing_style)
            written = export_from_bucket(args.checkpoint, args.out, args.max_shard_bytes, client)
        else:
            written = export(Path(args.checkpoint), args.out, args.max_shard_bytes)
    except (ExportError, OSError, ValueError) as exc:
        print(f"disttrain export: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
