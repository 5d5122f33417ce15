"""Manifest validation and retention: what resume may trust and what may be deleted."""

import json
from pathlib import Path

import pytest

from disttrain.api.manifest import MANIFEST_FILE, CheckpointManifest, DatasetFingerprint
from disttrain.trainer import commit


def make_checkpoint(root: Path, step: int, payload: bytes = b"x" * 1000) -> Path:
    tmp = root / commit.tmp_dir_name(step, "n")
    tmp.mkdir(parents=True)
    (tmp / ".metadata").write_bytes(b"meta" + str(step).encode())
    (tmp / "__0_0.distcp").write_bytes(payload)
    files = commit.digest_files(tmp, [".metadata", "__0_0.distcp"])
    manifest = CheckpointManifest(step=step, samples_consumed=step * 4, data_cursor=step * 4, world_size=2,
                                  plan={"worldSize": 2}, lr_scale=1.0, dataset=DatasetFingerprint(length=9, seed=0),
                                  metadata_sha256=files[".metadata"].digest.split(":")[1], files=files,
                                  created_at="now", code_version="t", config_hash="h")
    commit.write_manifest(tmp, manifest)
    return commit.publish(root, tmp, step)


def test_a_committed_checkpoint_validates(tmp_path):
    v = commit.validate(make_checkpoint(tmp_path, 4))
    assert v.ok and v.manifest.step == 4


@pytest.mark.parametrize(("damage", "problem"), [
    (lambda p: (p / MANIFEST_FILE).unlink(), "COMPLETE.json is missing"),
    (lambda p: (p / MANIFEST_FILE).write_text("{"), "does not parse"),
    (lambda p: (p / "__0_0.distcp").unlink(), "file __0_0.distcp is missing"),
    (lambda p: (p / "__0_0.distcp").write_bytes(b"x" * 999), "has 999 bytes"),
    (lambda p: (p / "__0_0.distcp").write_bytes(b"y" + b"x" * 999), "__0_0.distcp is corrupt"),
    (lambda p: (p / ".metadata").write_bytes(b"meta9"), ".metadata is corrupt"),
], ids=["no-manifest", "torn-manifest", "missing-shard", "truncated-shard", "flipped-byte", "changed-metadata"])
def test_a_damaged_checkpoint_is_rejected_with_the_reason(tmp_path, damage, problem):
    path = make_checkpoint(tmp_path, 4)
    damage(path)
    v = commit.validate(path)
    assert not v.ok and problem in v.problem


def test_resume_falls_back_to_the_newest_valid_checkpoint_and_says_why(tmp_path):
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 4)
    (make_checkpoint(tmp_path, 6) / "__0_0.distcp").write_bytes(b"z" * 1000)
    (tmp_path / commit.tmp_dir_name(8, "torn")).mkdir()
    messages: list[str] = []
    found = commit.find_latest(tmp_path, log=messages.append)
    assert found is not None and found.step == 4
    assert messages == [f"checkpoint step-6 is not usable (file __0_0.distcp is corrupt: digest "
                        f"{commit.file_digest(tmp_path / 'step-6' / '__0_0.distcp', 'crc32').digest}, expected "
                        f"{json.loads((tmp_path / 'step-6' / MANIFEST_FILE).read_text())['files']['__0_0.distcp']['digest']}"
                        "); falling back to an older checkpoint"]


@pytest.mark.parametrize(("steps", "keep", "protected", "deleted"), [
    ([2, 4, 6], 3, [], []),
    ([2, 4, 6, 8], 2, [], [2, 4]),
    ([2, 4, 6], 1, [], [2, 4]),
    ([2, 4, 6], 0, [], [2, 4]),  # never the newest complete one, whatever keep says
    ([2, 4, 6], 1, [2], [4]),
    ([], 1, [], []),
], ids=["within-keep", "beyond-keep", "keep-1", "keep-0-still-keeps-newest", "protected", "empty"])
def test_retention_choice(steps, keep, protected, deleted):
    assert commit.choose_deletions(steps, keep, protected) == deleted


def test_retention_removes_torn_saves_but_not_the_one_in_flight(tmp_path):
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 4)
    (tmp_path / ".tmp-step-6-dead").mkdir()
    (tmp_path / ".tmp-step-8-live").mkdir()
    commit.delete(tmp_path, commit.plan_retention(tmp_path, keep=1, in_flight=[".tmp-step-8-live"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-step-8-live", "step-4"]
