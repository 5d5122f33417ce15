"""Fixtures and helpers shared by the trainer's unit tests."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest
import torch.distributed as dist

from disttrain.api.manifest import CheckpointManifest, DatasetFingerprint
from disttrain.common.ports import free_port
from disttrain.trainer.checkpoint import commit


def make_checkpoint(
    root: Path, step: int, round_: int | None = None, payload: bytes = b"x" * 1000, nonce: str = "n"
) -> Path:
    """A committed checkpoint of fence round ``round_`` (None: written before rounds existed), one rank's files."""
    tmp = root / commit.tmp_dir_name(step, nonce, round_ or 0)
    tmp.mkdir(parents=True)
    (tmp / ".metadata").write_bytes(b"meta" + str(step).encode())
    (tmp / "__0_0.distcp").write_bytes(payload)
    files = commit.digest_files(tmp, [".metadata", "__0_0.distcp"])
    manifest = CheckpointManifest(
        step=step,
        samples_consumed=step * 4,
        data_cursor=step * 4,
        world_size=2,
        plan={"worldSize": 2},
        lr_scale=1.0,
        dataset=DatasetFingerprint(length=9, seed=0),
        metadata_sha256=files[".metadata"].digest.split(":")[1],
        files=files,
        created_at="now",
        code_version="t",
        config_hash="h",
        fence_round=round_,
    )
    commit.write_manifest(tmp, manifest)
    return commit.publish(root, tmp, step)


def plan_retention(
    root: Path, keep: int, own_round: int = 0, in_flight: Iterable[str] = (), protected: Iterable[int] = ()
) -> list[str]:
    """Both of the committer's retention plans at once, every checkpoint fully validated: the steps to delete
    (:func:`~disttrain.trainer.checkpoint.commit.plan_step_deletions`), then the temporary directories."""
    valid = lambda path: commit.validate(path).ok  # noqa: E731
    return commit.plan_step_deletions(root, keep, valid, protected, own_round or None) + commit.plan_temp_cleanup(
        root, own_round, in_flight
    )


@pytest.fixture
def one_process_group():
    """A real one-rank gloo process group, for code that needs collectives without other processes."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
