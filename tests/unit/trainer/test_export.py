"""Checkpoints are readable by DCP's own tools and by safetensors loaders: ``dcp_to_torch_save`` reads a
committed checkpoint, and ``disttrain export`` writes the model's weights (one file, or shards with an index)
equal to the model that was saved; a damaged or missing checkpoint is refused with a reason."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from tests.checkpoint_tensors import assert_readable_by_dcp
from tests.manifests import bare_manifest

from disttrain.api.spec import CheckpointSpec
from disttrain.common.ports import free_port
from disttrain.operator import cli
from disttrain.trainer.checkpoint import export
from disttrain.trainer.checkpoint import manager as ckpt_mod


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small model (bf16 and fp32 parameters), one AdamW step, committed at steps 1 and 2 by the manager."""
    root = tmp_path_factory.mktemp("ckpt")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
        model[2].to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        state = {"app": ckpt_mod.ModelOptimState(model, opt), "trainer": ckpt_mod.TrainerState()}
        manager = ckpt_mod.CheckpointManager(root, CheckpointSpec(keep=3), 0, 1, dist.group.WORLD)
        manager.save(1, state, bare_manifest(1, job="ns/demo"))
        x = model[0](torch.randn(4, 6)).relu()
        model[2](x.to(torch.bfloat16)).float().sum().backward()
        opt.step()
        manager.save(2, state, bare_manifest(2, job="ns/demo"))
        manager.close()
    finally:
        dist.destroy_process_group()
    return root, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_dcps_own_converter_reads_a_committed_checkpoint(trained, tmp_path):
    root, weights = trained
    converted = assert_readable_by_dcp(root / "step-2", tmp_path / "step-2.pt")
    for key, value in weights.items():
        assert torch.equal(converted["app"]["model"][key], value), key
    assert converted["trainer"]["step"] == 0  # non-tensor state comes through too


def test_export_writes_the_newest_checkpoints_weights_as_one_safetensors_file(trained, tmp_path):
    root, weights = trained
    assert cli.main(["export", str(root), str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    loaded = load_file(tmp_path / "out" / "model.safetensors")
    assert loaded.keys() == weights.keys()
    for key, value in weights.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key


def test_export_above_the_shard_size_writes_shards_and_an_index_naming_every_key(trained, tmp_path):
    root, weights = trained
    assert export.main([str(root / "step-2"), str(tmp_path), "--max-shard-bytes", "64"]) == 0
    index = json.loads((tmp_path / export.INDEX_FILE).read_text())
    assert index["metadata"]["step"] == "2" and index["metadata"]["job"] == "ns/demo"
    assert index["weight_map"].keys() == weights.keys()
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[-1].endswith(f"-of-{len(files):05d}.safetensors")
    for name in files:
        for key, value in load_file(tmp_path / name).items():
            assert index["weight_map"][key] == name and torch.equal(value, weights[key]), key


def test_an_older_step_can_be_exported_by_its_directory(trained, tmp_path):
    root, weights = trained
    assert export.main([str(root / "step-1"), str(tmp_path)]) == 0
    loaded = load_file(tmp_path / "model.safetensors")
    assert any(not torch.equal(loaded[k], weights[k]) for k in weights)  # step 1 is before the optimizer step


def test_a_damaged_checkpoint_or_none_at_all_is_refused_with_the_reason(trained, tmp_path, capsys):
    root, _ = trained
    assert export.main([str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert "no valid checkpoint" in capsys.readouterr().err
    damaged = tmp_path / "step-2"
    shutil.copytree(root / "step-2", damaged)
    shard = next(damaged.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert export.main([str(damaged), str(tmp_path / "out")]) == 2
    assert "not a valid checkpoint" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_shards_are_consecutive_keys_within_the_bound_and_a_larger_tensor_stands_alone():
    sizes = {"a": 40, "b": 30, "c": 100, "d": 10, "e": 20}
    assert export.plan_shards(sizes, 75) == [["a", "b"], ["c"], ["d", "e"]]
    assert export.plan_shards(sizes, 10**9) == [sorted(sizes)]
