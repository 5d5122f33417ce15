"""Manifest validation and retention: what resume may trust and what may be deleted."""

import errno
import json
import threading

import pydantic
import pytest
from tests.unit.trainer.conftest import make_checkpoint, plan_retention

from disttrain.api.manifest import MANIFEST_FILE, CheckpointManifest
from disttrain.trainer.checkpoint import commit, fence


def test_a_committed_checkpoint_validates(tmp_path):
    v = commit.validate(make_checkpoint(tmp_path, 4))
    assert v.ok and v.manifest.step == 4


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda p: (p / MANIFEST_FILE).unlink(), "COMPLETE.json is missing"),
        (lambda p: (p / MANIFEST_FILE).write_text("{"), "does not parse"),
        (lambda p: (p / "__0_0.distcp").unlink(), "file __0_0.distcp is missing"),
        (lambda p: (p / "__0_0.distcp").write_bytes(b"x" * 999), "has 999 bytes"),
        (lambda p: (p / "__0_0.distcp").write_bytes(b"y" + b"x" * 999), "__0_0.distcp is corrupt"),
        (lambda p: (p / ".metadata").write_bytes(b"meta9"), ".metadata is corrupt"),
    ],
    ids=["no-manifest", "torn-manifest", "missing-shard", "truncated-shard", "flipped-byte", "changed-metadata"],
)
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
    assert messages == [
        f"checkpoint step-6 is not usable (file __0_0.distcp is corrupt: digest "
        f"{commit.file_digest(tmp_path / 'step-6' / '__0_0.distcp', 'crc32').digest}, expected "
        f"{json.loads((tmp_path / 'step-6' / MANIFEST_FILE).read_text())['files']['__0_0.distcp']['digest']}"
        "); falling back to an older checkpoint"
    ]


def test_an_unknown_digest_algorithm_falls_back_to_an_older_checkpoint(tmp_path):
    make_checkpoint(tmp_path, 2)
    manifest_path = make_checkpoint(tmp_path, 4) / MANIFEST_FILE
    data = json.loads(manifest_path.read_text())
    data["files"]["__0_0.distcp"]["digest"] = data["files"]["__0_0.distcp"]["digest"].replace("crc32:", "crc33:")
    manifest_path.write_text(json.dumps(data))
    messages: list[str] = []
    found = commit.find_latest(tmp_path, log=messages.append)
    assert found is not None and found.step == 2
    assert messages == [
        "checkpoint step-4 is not usable (file __0_0.distcp has an unknown digest algorithm "
        "'crc33'); falling back to an older checkpoint"
    ]


@pytest.mark.parametrize("name", ["/etc/passwd", "../step-2/.metadata", "a/../../b", "./x", "a//b", "a\\..\\b", ""])
def test_a_manifest_refuses_file_names_outside_the_checkpoint(tmp_path, name):
    data = json.loads((make_checkpoint(tmp_path, 4) / MANIFEST_FILE).read_text())
    data["files"][name] = {"size": 1, "digest": "crc32:00000000"}
    with pytest.raises(pydantic.ValidationError, match="files"):
        CheckpointManifest.model_validate(data)


def test_a_manifest_naming_a_file_outside_the_checkpoint_is_rejected_at_resume(tmp_path):
    make_checkpoint(tmp_path, 2)
    manifest_path = make_checkpoint(tmp_path, 4) / MANIFEST_FILE
    data = json.loads(manifest_path.read_text())
    data["files"]["../step-2/.metadata"] = data["files"][".metadata"]
    manifest_path.write_text(json.dumps(data))
    found = commit.find_latest(tmp_path)
    assert found is not None and found.step == 2


def test_re_saving_a_step_replaces_it_in_place(tmp_path):
    make_checkpoint(tmp_path, 4, payload=b"old" * 100)
    make_checkpoint(tmp_path, 4, payload=b"new" * 100, nonce="again")
    assert (tmp_path / "step-4" / "__0_0.distcp").read_bytes() == b"new" * 100
    assert commit.validate(tmp_path / "step-4").ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4"]


def test_a_failed_re_save_leaves_the_existing_step_in_place(tmp_path):
    make_checkpoint(tmp_path, 4)
    with pytest.raises(FileNotFoundError):  # the new directory never arrives (its rename fails)
        commit.publish(tmp_path, tmp_path / commit.tmp_dir_name(4, "vanished"), 4)
    assert commit.validate(tmp_path / "step-4").ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4"]


def test_retention_after_a_fallback_from_a_corrupt_checkpoint_keeps_the_valid_ones(tmp_path):
    """The reported loss: step-100 corrupt, the run fell back to step-90 and committed step-95 with keep 1."""
    make_checkpoint(tmp_path, 90)
    (make_checkpoint(tmp_path, 100) / "__0_0.distcp").write_bytes(b"z" * 1000)
    make_checkpoint(tmp_path, 95)
    # The corrupt step-100 neither counts towards keep nor is kept: it is cleaned; the loaded step-90 stays.
    assert plan_retention(tmp_path, keep=1, protected=[90, 95]) == ["step-100"]
    assert plan_retention(tmp_path, keep=1, protected=[95]) == ["step-100", "step-90"]


def test_retention_never_counts_a_checkpoint_without_a_manifest_and_removes_it(tmp_path):
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 4)
    (make_checkpoint(tmp_path, 6) / MANIFEST_FILE).unlink()
    assert plan_retention(tmp_path, keep=1) == ["step-6", "step-2"]


@pytest.mark.parametrize(
    ("steps", "keep", "protected", "deleted"),
    [
        ([2, 4, 6], 3, [], []),
        ([2, 4, 6, 8], 2, [], [2, 4]),
        ([2, 4, 6], 1, [], [2, 4]),
        ([2, 4, 6], 0, [], [2, 4]),  # never the newest complete one, whatever keep says
        ([2, 4, 6], 1, [2], [4]),
        ([], 1, [], []),
    ],
    ids=["within-keep", "beyond-keep", "keep-1", "keep-0-still-keeps-newest", "protected", "empty"],
)
def test_retention_choice(steps, keep, protected, deleted):
    assert commit.choose_deletions([(1, s) for s in steps], keep, protected) == deleted


@pytest.mark.parametrize(
    ("valid", "keep", "deleted"),
    [
        ([(1, 5), (2, 4)], 1, [5]),  # a stale round's higher step is older than the newer round's checkpoint
        ([(1, 5), (2, 4), (2, 2)], 2, [5]),
        ([(0, 9), (1, 3)], 1, [9]),  # a checkpoint from before rounds existed counts as round 0
        ([(3, 7), (3, 8), (2, 9)], 2, [9]),
    ],
    ids=["stale-higher-step", "keep-2", "legacy-round-0", "same-round-by-step"],
)
def test_retention_keeps_the_newest_by_round_then_step(valid, keep, deleted):
    assert commit.choose_deletions(valid, keep) == deleted


def test_retention_removes_torn_saves_but_not_the_one_in_flight(tmp_path):
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 4)
    (tmp_path / commit.tmp_dir_name(6, "dead", 3)).mkdir()
    (tmp_path / commit.tmp_dir_name(8, "live", 3)).mkdir()
    live = commit.tmp_dir_name(8, "live", 3)
    commit.delete(tmp_path, plan_retention(tmp_path, keep=1, own_round=3, in_flight=[live]))
    assert sorted(p.name for p in tmp_path.iterdir()) == [live, "step-4"]


def test_retention_removes_its_own_and_older_rounds_temp_dirs_never_a_newer_rounds(tmp_path):
    names = [
        commit.tmp_dir_name(6, "a", 1),
        commit.tmp_dir_name(6, "b", 2),
        commit.tmp_dir_name(8, "c", 3),
        ".tmp-step-4-legacy",
        ".trash-step-4-r3-d",
    ]
    for name in names:
        (tmp_path / name).mkdir()
    assert commit.plan_temp_cleanup(tmp_path, own_round=2) == sorted(
        [commit.tmp_dir_name(6, "a", 1), commit.tmp_dir_name(6, "b", 2), ".tmp-step-4-legacy"]
    )


def test_each_new_group_claims_a_higher_fence_round_and_older_rounds_are_refused(tmp_path):
    first = fence.claim(tmp_path, "uid-1", "node-a")
    second = fence.claim(tmp_path, "uid-1", "node-b")
    assert (first, second) == (1, 2)
    fence.check(tmp_path, second)
    with pytest.raises(fence.FencedError, match=r"holds round 1, a newer group holds round 2 \(claimed by node node-b"):
        fence.check(tmp_path, first)
    fence.retire_older(tmp_path, second)
    assert fence.current_round(tmp_path) == 2 and fence.read(tmp_path, 1) is None


def test_concurrent_claims_never_share_a_round(tmp_path):
    rounds: list[int] = []
    threads = [
        threading.Thread(target=lambda i=i: rounds.append(fence.claim(tmp_path, "u", f"n{i}"))) for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(rounds) == list(range(1, 9))


def test_disk_full_is_recognised_through_dcp_wrapping():
    class Wrapped(BaseException):  # the shape of DCP's CheckpointException: per-rank (exception, traceback)
        def __init__(self, failures):
            super().__init__("wrapped")
            self.failures = failures

    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("write failed") from inner
    except RuntimeError as exc:
        assert commit.is_disk_full(Wrapped({1: (exc, None)}))
    assert not commit.is_disk_full(Wrapped({0: (OSError(errno.EIO, "I/O error"), None)}))
