"""A checkpoint that never committed, or was corrupted after committing, is never loaded."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from disttrain.api.manifest import MANIFEST_FILE
from disttrain.trainer.checkpoint import commit

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_kill_during_save_before_commit_leaves_the_previous_checkpoint_loaded_and_kept(harness):
    contract = harness.contract(global_batch=4, micro=1, max_steps=8, interval=2, keep=1)
    rc, log = harness.run(2, contract, "crash", TOY_FAULT="kill_before_commit:4")
    assert rc != 0, log[-3000:]
    assert "SIGKILL before COMPLETE.json of step 4" in log
    names = harness.ckpt_names()
    assert "step-2" in names and "step-4" not in names, names  # keep=1 never removed the newest complete one
    assert any(n.startswith(".tmp-step-4-") for n in names), names  # the torn save is still there, uncommitted

    rc, log = harness.run(2, contract, "after")
    assert rc == 0, log[-3000:]
    assert "resumed from checkpoint step-2" in log
    assert min(r["step"] for r in harness.records("after")) == 3
    names = harness.ckpt_names()
    # The torn temp dir was cleaned up by retention; step-2, which this run loaded, is kept for the whole run.
    assert names == ["step-2", "step-8"], names


def test_a_corrupt_shard_is_detected_and_the_previous_checkpoint_is_used(harness):
    contract = harness.contract(global_batch=4, micro=1, max_steps=4, interval=2, keep=3)
    rc, log = harness.run(2, contract, "first")
    assert rc == 0, log[-3000:]
    shard = max((harness.ckpt / "step-4").glob("__*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the digest can tell
    shard.write_bytes(bytes(data))

    longer = harness.contract(global_batch=4, micro=1, max_steps=6, interval=2, keep=3)
    rc, log = harness.run(2, longer, "second")
    assert rc == 0, log[-3000:]
    assert f"checkpoint step-4 is not usable (file {shard.name} is corrupt" in log
    assert "falling back to an older checkpoint" in log
    assert "resumed from checkpoint step-2" in log
    assert min(r["step"] for r in harness.records("second")) == 3


def test_a_failed_async_save_surfaces_at_a_boundary_is_retried_and_async_checkpoints_resume(harness):
    contract = harness.contract(global_batch=4, micro=1, max_steps=12, interval=4, keep=3, async_save=True)
    rc, log = harness.run(
        2, contract, "fail", TOY_FAULT="fail_write:4", TOY_STEP_SLEEP="0.15", TOY_DRAIN_AT="9"
    )  # drains at step 10
    assert "drained at step 10" in log, log[-3000:]
    failed = re.search(
        r"checkpoint save at step 4 FAILED \(1 in a row\): OSError\('fault injection.*\n.*"
        r"checkpoint step-(\d+) committed",
        log,
    )
    assert failed, log[-3000:]
    retry = int(failed.group(1))
    assert 4 < retry < 8  # retried at the boundary where the failure surfaced, not at the next interval
    assert set(harness.ckpt_names()) == {f"step-{retry}", "step-8", "step-10"}

    rc, log = harness.run(2, contract, "rest")
    assert rc == 0, log[-3000:]
    assert "resumed from checkpoint step-10" in log
    rows = harness.records("fail") + harness.records("rest")
    assert sorted(r["step"] for r in rows if r["rank"] == 0) == list(range(1, 13))
    assert sum(len(r["indices"]) for r in rows) == 12 * 4


def test_after_a_fallback_from_a_corrupt_checkpoint_retention_keeps_every_valid_one_it_needs(harness):
    """The reported loss, on real processes: step-4 corrupt, resume falls back to step-2, commits step-3 with
    keep 1. Counting the corrupt step-4 as "complete" deleted step-3 and step-2, leaving nothing to resume."""
    rc, log = harness.run(2, harness.contract(global_batch=4, micro=1, max_steps=4, interval=2, keep=3), "first")
    assert rc == 0, log[-3000:]
    shard = max((harness.ckpt / "step-4").glob("__*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    rc, log = harness.run(2, harness.contract(global_batch=4, micro=1, max_steps=3, interval=3, keep=1), "second")
    assert rc == 0, log[-3000:]
    assert "resumed from checkpoint step-2" in log
    assert harness.ckpt_names() == ["step-2", "step-3"]  # loaded, newest valid; the corrupt step-4 was cleaned

    rc, log = harness.run(2, harness.contract(global_batch=4, micro=1, max_steps=4, interval=2, keep=1), "third")
    assert rc == 0, log[-3000:]
    assert "resumed from checkpoint step-3" in log
    assert harness.ckpt_names() == ["step-3", "step-4"]
    rows = [r for r in harness.records("second") + harness.records("third") if r["rank"] == 0]
    assert sorted(r["step"] for r in rows) == [3, 4]


class FullDisk:
    """A checkpoint volume that fills up: a real 1 MiB tmpfs filled to the last pages (needs root and mount),
    or, where that is impossible, the ``enospc_from`` fault hook raising OSError(ENOSPC) from every save."""

    def __init__(self, kind: str, tmp: Path) -> None:
        self.kind = kind
        self.ckpt = tmp / "small"
        self.filler = self.ckpt / "filler"
        self.env: dict[str, str] = {}
        self.mounted = False

    def mount(self) -> None:
        if self.kind == "hook":
            return
        if os.geteuid() != 0:
            pytest.skip("a real full disk needs root to mount a small tmpfs; the hook variant covers the rest")
        self.ckpt.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(self.ckpt)], capture_output=True, text=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        self.mounted = True

    def fill(self) -> None:
        """Fill every page, then give two back: room for the next group's fence record, not for a checkpoint."""
        if self.kind == "hook":
            self.env = {"TOY_FAULT": "enospc_from:3"}
            return
        with open(self.filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as exc:
                assert exc.errno == 28, exc
        os.truncate(self.filler, max(0, self.filler.stat().st_size - 2 * 4096))

    def free(self) -> None:
        self.env = {}
        if self.filler.exists():
            self.filler.unlink()

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.ckpt)], check=False)


@pytest.fixture(params=["tmpfs", "hook"])
def full_disk(request, harness):
    disk = FullDisk(request.param, harness.tmp)
    disk.mount()
    yield disk
    harness.cleanup()
    disk.unmount()


def test_a_full_disk_is_a_clear_error_and_training_resumes_from_the_last_good_checkpoint(harness, full_disk):
    ckpt = full_disk.ckpt
    rc, log = harness.run(
        2, harness.contract(global_batch=4, micro=1, max_steps=2, interval=2, keep=1), "first", ckpt=ckpt
    )
    assert rc == 0, log[-3000:]
    full_disk.fill()

    longer = harness.contract(global_batch=4, micro=1, max_steps=5, interval=3, keep=1)
    rc, log = harness.run(2, longer, "full", ckpt=ckpt, **full_disk.env)
    assert rc != 0, log[-3000:]
    assert "disk full (ENOSPC) writing checkpoint step-3" in log, log[-3000:]
    assert "2 checkpoint saves in a row failed" in log, log[-3000:]
    names = [n for n in harness.ckpt_names(ckpt) if n != "filler"]
    assert names == ["step-2"], names  # the failed saves' temp dirs are gone; the last good one is untouched
    assert commit.validate(ckpt / "step-2").ok

    full_disk.free()
    rc, log = harness.run(2, longer, "after", ckpt=ckpt)
    assert rc == 0, log[-3000:]
    assert "resumed from checkpoint step-2" in log
    rows = [r for r in harness.records("first") + harness.records("after") if r["rank"] == 0]
    assert sorted(r["step"] for r in rows) == [1, 2, 3, 4, 5]


def test_links_and_leftovers_in_the_checkpoint_tree_are_refused_cleaned_and_never_followed(harness):
    """Real torchrun, two ranks. Planted in the tree: ``step-9``, a link to another job's valid checkpoint (with a
    higher fence round: followed, it would win); a ``.metadata`` that is a link to an identical copy outside;
    a look-alike ``step-04``, a torn ``step-7`` and a dead group's temp dir. Resume follows none of the links,
    retention removes every planted entry (links as links) and the other job's files are untouched."""
    rc, log = harness.run(2, harness.contract(global_batch=4, micro=1, max_steps=4, interval=2, keep=3), "first")
    assert rc == 0, log[-3000:]
    ckpt, other = harness.ckpt, harness.tmp / "other-job"
    shutil.copytree(ckpt / "step-4", other / "step-9")
    manifest = json.loads((other / "step-9" / MANIFEST_FILE).read_text())
    (other / "step-9" / MANIFEST_FILE).write_text(json.dumps({**manifest, "step": 9, "fence_round": 99}))
    assert commit.validate(other / "step-9").ok  # a checkpoint resume would take, were the link followed
    (ckpt / "step-9").symlink_to(other / "step-9")
    shutil.copy(ckpt / "step-4" / ".metadata", other / "metadata-copy")
    (ckpt / "step-4" / ".metadata").unlink()
    (ckpt / "step-4" / ".metadata").symlink_to(other / "metadata-copy")
    shutil.copytree(ckpt / "step-2", ckpt / "step-04")
    (ckpt / "step-7").mkdir()
    (ckpt / commit.tmp_dir_name(5, "deadbeef0001", 1)).mkdir()

    rc, log = harness.run(2, harness.contract(global_batch=4, micro=1, max_steps=6, interval=2, keep=1), "second")
    assert rc == 0, log[-3000:]
    assert "checkpoint step-9 is not usable (is a symbolic link" in log, log[-3000:]
    assert "checkpoint step-4 is not usable (file .metadata is a symbolic link" in log, log[-3000:]
    assert "resumed from checkpoint step-2" in log
    assert min(r["step"] for r in harness.records("second")) == 3
    assert harness.ckpt_names() == ["step-2", "step-6"]  # loaded, newest; every planted entry is gone
    assert commit.validate(other / "step-9").ok and (other / "metadata-copy").is_file()
    assert not commit.is_link(ckpt / "step-6") and commit.validate(ckpt / "step-6").ok
