"""What no stale group, leftover or link in the checkpoint tree can do: shadow or replace a newer round's
checkpoint, survive retention, or make validation, loading or deletion follow a link out of the tree."""

import json
import os
import pickle
from pathlib import Path

import pytest
from tests.unit.trainer.conftest import make_checkpoint, plan_retention

from disttrain.api.manifest import MANIFEST_FILE
from disttrain.trainer.checkpoint import commit, fence, storage


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


# ---- order: (fence round, step) ------------------------------------------------------------------------------


def test_resume_picks_the_newer_round_over_a_stale_rounds_higher_step(tmp_path):
    make_checkpoint(tmp_path, 2, round_=1)
    make_checkpoint(tmp_path, 5, round_=1)  # the stale group's late commit
    make_checkpoint(tmp_path, 4, round_=2)
    found = commit.find_latest(tmp_path)
    assert found is not None and found.step == 4 and found.manifest.fence_round == 2


def test_a_checkpoint_without_a_round_is_older_than_any_round(tmp_path):
    make_checkpoint(tmp_path, 9, round_=None)
    make_checkpoint(tmp_path, 3, round_=1)
    assert commit.find_latest(tmp_path).step == 3


def test_an_older_round_cannot_publish_past_a_newer_rounds_checkpoint(tmp_path):
    make_checkpoint(tmp_path, 4, round_=2)
    tmp = tmp_path / commit.tmp_dir_name(5, "stale", 1)
    tmp.mkdir()
    with pytest.raises(fence.FencedError, match="holds step-4 committed by fence round 2; this group holds round 1"):
        commit.publish(tmp_path, tmp, 5, own_round=1)
    assert names(tmp_path) == [tmp.name, "step-4"]


def test_an_older_round_cannot_replace_a_newer_rounds_checkpoint_of_the_same_step(tmp_path):
    newer = make_checkpoint(tmp_path, 4, round_=2, payload=b"new" * 100)
    stale = tmp_path / commit.tmp_dir_name(4, "stale", 1)
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"old" * 100)
    with pytest.raises(fence.FencedError, match="must not publish step-4"):
        commit.publish(tmp_path, stale, 4, own_round=1)
    with pytest.raises(fence.FencedError, match="must not replace it"):  # the check inside the swap itself
        commit._replace_existing(tmp_path, stale, newer, own_round=1)
    assert (newer / "__0_0.distcp").read_bytes() == b"new" * 100
    assert commit.validate(newer).manifest.fence_round == 2


def test_a_swap_that_displaced_a_newer_rounds_checkpoint_is_undone(tmp_path):
    """The newer round published step-4 between the stale publish's check and its swap: after the swap the newer
    one sits under the stale temp name, and it is put back."""
    make_checkpoint(tmp_path, 4, round_=1, payload=b"old" * 100)  # the stale copy, swapped in
    other = tmp_path / "other"
    other.mkdir()
    displaced = tmp_path / commit.tmp_dir_name(4, "stale", 1)
    make_checkpoint(other, 4, round_=2, payload=b"new" * 100).rename(displaced)
    with pytest.raises(fence.FencedError, match="the newer one was put back"):
        commit.put_back_if_newer(displaced, tmp_path / "step-4", own_round=1)
    assert commit.validate(tmp_path / "step-4").manifest.fence_round == 2
    assert (tmp_path / "step-4" / "__0_0.distcp").read_bytes() == b"new" * 100
    assert commit.validate(displaced).manifest.fence_round == 1  # the stale copy, left for its owner to remove
    commit.put_back_if_newer(displaced, tmp_path / "step-4", own_round=2)  # not newer than round 2: no swap
    assert commit.validate(tmp_path / "step-4").manifest.fence_round == 2


def test_a_newer_round_replaces_an_older_rounds_checkpoint_of_the_same_step(tmp_path):
    make_checkpoint(tmp_path, 4, round_=1, payload=b"old" * 100)
    make_checkpoint(tmp_path, 4, round_=2, payload=b"new" * 100, nonce="again")
    v = commit.validate(tmp_path / "step-4")
    assert v.ok and v.manifest.fence_round == 2
    assert names(tmp_path) == ["step-4"]


def test_a_claim_starts_above_every_committed_round_even_when_the_fence_was_lost(tmp_path):
    make_checkpoint(tmp_path, 4, round_=7)
    assert commit.newest_committed(tmp_path) == (7, "step-4")
    assert fence.claim(tmp_path, "u", "n", floor=commit.newest_committed(tmp_path)[0]) == 8


def test_a_fence_directory_that_is_a_link_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / fence.FENCE_DIR).symlink_to(elsewhere)
    with pytest.raises(fence.FencedError, match="is a symbolic link"):
        fence.claim(root, "u", "n")
    assert list(elsewhere.iterdir()) == []


# ---- retention cleans what is invalid ------------------------------------------------------------------------


def test_retention_cleans_invalid_and_look_alike_entries_but_never_the_newest_or_a_newer_round(tmp_path):
    make_checkpoint(tmp_path, 2, round_=1)
    make_checkpoint(tmp_path, 4, round_=2)
    make_checkpoint(tmp_path, 8, round_=3)  # a newer round than the caller's: never touched
    (make_checkpoint(tmp_path, 6, round_=2) / MANIFEST_FILE).unlink()  # torn
    (make_checkpoint(tmp_path, 7, round_=2) / MANIFEST_FILE).write_text("{")  # unparsable
    (make_checkpoint(tmp_path, 9, round_=1) / "__0_0.distcp").write_bytes(b"y" * 1000)  # corrupt
    (tmp_path / "step-04").mkdir()
    (tmp_path / "step-4.bak").write_text("x")
    (tmp_path / "step-").mkdir()
    (tmp_path / "unrelated").mkdir()
    planned = plan_retention(tmp_path, keep=1, own_round=2)
    assert planned == ["step-", "step-04", "step-4.bak", "step-6", "step-7", "step-9", "step-2"]
    commit.delete(tmp_path, planned)
    assert names(tmp_path) == ["step-4", "step-8", "unrelated"]


def test_retention_never_removes_a_newer_rounds_temp_dir_nor_the_save_in_flight(tmp_path):
    make_checkpoint(tmp_path, 2, round_=2)
    for name in [
        commit.tmp_dir_name(3, "dead", 1),
        commit.tmp_dir_name(3, "live", 2),
        commit.tmp_dir_name(3, "next", 3),
    ]:
        (tmp_path / name).mkdir()
    planned = plan_retention(tmp_path, keep=1, own_round=2, in_flight=[commit.tmp_dir_name(3, "live", 2)])
    assert planned == [commit.tmp_dir_name(3, "dead", 1)]


# ---- links are never followed --------------------------------------------------------------------------------


def other_jobs_checkpoint(tmp_path: Path) -> Path:
    """A valid checkpoint of another job, in another tree: what a link in this tree would lead to."""
    other = tmp_path / "other-job"
    other.mkdir()
    return make_checkpoint(other, 9, round_=50)


def test_a_step_directory_that_is_a_link_is_invalid_and_retention_unlinks_only_the_link(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    make_checkpoint(root, 2, round_=1)
    target = other_jobs_checkpoint(tmp_path)
    (root / "step-9").symlink_to(target)
    assert (
        commit.validate(root / "step-9").problem
        == "is a symbolic link (links in the checkpoint tree are never followed)"
    )
    messages: list[str] = []
    assert commit.find_latest(root, log=messages.append).step == 2
    assert messages == [
        "checkpoint step-9 is not usable (is a symbolic link (links in the checkpoint tree are never "
        "followed)); falling back to an older checkpoint"
    ]
    assert commit.newest_committed(root) == (1, "step-2")  # the link's round 50 is not believed either
    planned = plan_retention(root, keep=1, own_round=1)
    assert planned == ["step-9"]
    commit.delete(root, planned)
    assert names(root) == ["step-2"]
    assert commit.validate(target).ok  # the other job's checkpoint is untouched


@pytest.mark.parametrize("name", [MANIFEST_FILE, ".metadata", "__0_0.distcp"])
def test_a_file_that_is_a_link_is_refused_even_when_its_target_matches(tmp_path, name):
    root = tmp_path / "ckpt"
    root.mkdir()
    path = make_checkpoint(root, 4, round_=1)
    copy = tmp_path / f"copy-of-{name}"
    copy.write_bytes((path / name).read_bytes())  # same bytes: only refusing the link can tell
    (path / name).unlink()
    (path / name).symlink_to(copy)
    v = commit.validate(path)
    assert not v.ok and "symbolic link" in v.problem, v.problem


def test_deleting_a_checkpoint_does_not_follow_links_inside_it(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("mine")
    step = make_checkpoint(root, 2, round_=1)
    (step / "escape").symlink_to(precious)
    (step / "escape-file").symlink_to(precious / "keep.txt")
    assert commit.delete(root, ["step-2"]) == ["step-2"]
    assert names(root) == [] and (precious / "keep.txt").read_text() == "mine"


def test_re_saving_over_a_linked_step_directory_replaces_the_link_not_its_target(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    target = other_jobs_checkpoint(tmp_path)
    (root / "step-9").symlink_to(target)
    make_checkpoint(root, 9, round_=1)
    assert not commit.is_link(root / "step-9") and commit.validate(root / "step-9").ok
    assert commit.validate(target).ok and names(root) == ["step-9"]


# ---- .metadata is unpickled only once it matches the manifest -------------------------------------------------


class _Touch:
    """A pickle that creates a file when it is loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_a_metadata_pickle_that_is_not_the_committed_one_is_never_unpickled(tmp_path):
    path = make_checkpoint(tmp_path / "ckpt", 4, round_=1)
    ran = tmp_path / "code-ran"
    (path / ".metadata").write_bytes(pickle.dumps(_Touch(ran)))
    with pytest.raises(storage.MetadataMismatchError, match="is never unpickled"):
        storage.CheckpointReader(str(path)).read_metadata()
    expected = json.loads((path / MANIFEST_FILE).read_text())["metadata_sha256"]
    with pytest.raises(storage.MetadataMismatchError):
        storage.CheckpointReader(str(path), expected_metadata_sha256=expected).read_metadata()
    (path / MANIFEST_FILE).unlink()
    with pytest.raises(storage.MetadataMismatchError, match="no committed hash"):
        storage.CheckpointReader(str(path)).read_metadata()
    assert not ran.exists()


def test_the_reader_does_not_follow_a_linked_metadata_file(tmp_path):
    path = make_checkpoint(tmp_path / "ckpt", 4, round_=1)
    copy = tmp_path / "meta-copy"
    copy.write_bytes((path / ".metadata").read_bytes())
    os.unlink(path / ".metadata")
    (path / ".metadata").symlink_to(copy)
    with pytest.raises(commit.LinkError, match="symbolic link"):
        storage.CheckpointReader(str(path)).read_metadata()
