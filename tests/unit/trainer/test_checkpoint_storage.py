"""The checkpoint write path: tensors larger than a writeback slice come back bit for bit with digests that match
the files, and DCP's plan cache replans when the saved state's layout changes between two saves."""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from tests.checkpoint_tensors import load_tensors
from tests.manifests import bare_manifest

from disttrain.api.spec import CheckpointSpec
from disttrain.trainer.checkpoint import commit, storage, writeback
from disttrain.trainer.checkpoint import manager as ckpt_mod


def test_starting_writeback_of_a_written_range_is_accepted_on_linux(tmp_path):
    path = tmp_path / "f"
    with open(path, "wb") as f:
        f.write(b"x" * 65536)
        f.flush()
        started = writeback.start_writeback(f.fileno(), 0, 65536)
    assert started == (writeback._sync_file_range is not None)
    assert not writeback.start_writeback(0, 0, 0)  # nothing to write back


def test_tensors_spanning_several_writeback_slices_round_trip_with_digests_of_the_files(tmp_path, one_process_group):
    g = torch.Generator().manual_seed(0)
    n = storage.WRITEBACK_SLICE // 4  # float32: one slice of bytes
    state = {
        "big": torch.randn(2 * n + 123, generator=g),  # three slices, the last one partial
        "exact": torch.randn(n, generator=g),  # exactly one slice
        "small": torch.randn(7, generator=g),
        "empty": torch.empty(0),
        "meta": {"note": "not a tensor"},
    }
    writer = storage.CheckpointWriter(str(tmp_path), thread_count=2)
    dcp.save(state, storage_writer=writer)
    shards = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".distcp"))
    assert shards and sorted(writer.digests) == shards
    for name in shards:
        data = (tmp_path / name).read_bytes()
        assert writer.digests[name] == (len(data), f"crc32:{zlib.crc32(data):08x}")
        assert commit.file_digest(tmp_path / name, "crc32").digest == writer.digests[name][1]
    meta = commit.file_digest(tmp_path / commit.METADATA_FILE, "sha256")
    commit.write_manifest(  # committed: the reader unpickles .metadata only once it matches this hash
        tmp_path, bare_manifest(0, metadata_sha256=meta.digest.split(":", 1)[1])
    )
    loaded = load_tensors(tmp_path, prefix="")
    for key in ("big", "exact", "small", "empty"):
        assert torch.equal(loaded[key], state[key]), key


def test_a_save_after_the_state_gained_tensors_holds_them_despite_the_cached_plan(tmp_path, one_process_group):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = {"app": ckpt_mod.ModelOptimState(model, opt), "trainer": ckpt_mod.TrainerState()}
    manager = ckpt_mod.CheckpointManager(tmp_path, CheckpointSpec(keep=3), 0, 1, dist.group.WORLD)
    manager.save(1, state, bare_manifest(1))  # no optimizer state yet: the plan DCP caches has none
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    manager.save(2, state, bare_manifest(2))  # the moments exist now
    with torch.no_grad():
        model.weight.add_(1.0)
    manager.save(3, state, bare_manifest(3))  # same layout: the cached plan, new values
    manager.close()
    second, third = load_tensors(tmp_path / "step-2"), load_tensors(tmp_path / "step-3")
    moments = [k for k in second if k.startswith("app.optim.state.")]
    assert moments, sorted(second)
    assert torch.equal(third["app.model.weight"], model.weight.detach())
    assert torch.equal(second["app.model.weight"] + 1.0, third["app.model.weight"])
    for path in (tmp_path / "step-2", tmp_path / "step-3"):
        assert commit.validate(path).ok


def test_checkpoints_whose_items_are_raw_tensor_bytes_still_load(tmp_path, one_process_group, monkeypatch):
    """Volumes keep checkpoints written with each tensor as its raw bytes (no archive): resume reads them."""
    g = torch.Generator().manual_seed(1)
    state = {"w": torch.randn(5, 3, generator=g), "h": torch.randn(4, generator=g).half(), "empty": torch.empty(0)}

    def raw_bytes(stream, tensor):
        stream.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

    monkeypatch.setattr(storage, "write_tensor", raw_bytes)
    dcp.save(state, storage_writer=storage.CheckpointWriter(str(tmp_path)))
    monkeypatch.undo()
    meta = commit.file_digest(tmp_path / commit.METADATA_FILE, "sha256")
    commit.write_manifest(tmp_path, bare_manifest(0, metadata_sha256=meta.digest.split(":", 1)[1]))
    assert sum(p.stat().st_size for p in tmp_path.glob("*.distcp")) == 5 * 3 * 4 + 4 * 2  # raw: no archive
    loaded = load_tensors(tmp_path, prefix="")
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key
