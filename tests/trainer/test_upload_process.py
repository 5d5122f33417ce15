"""A rank's checkpoint uploads in a process of their own (trainer/checkpoint/uploadprocess.py), against a real S3
server (Ceph RADOS Gateway, tests/s3server.py) and with real processes: the objects arrive from another process at
the lowest CPU priority; an upload process killed in the middle of an upload is replaced and the upload completes;
the upload process ends when the trainer process dies; where no upload process can be started, the uploads run in
this one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tests.manifests import bare_manifest
from tests.trainer.conftest import bucket_credentials

from disttrain.api.spec import CheckpointSpec
from disttrain.trainer.checkpoint import commit
from disttrain.trainer.checkpoint.committer import CheckpointPhase
from disttrain.trainer.checkpoint.manager import CheckpointManager
from disttrain.trainer.checkpoint.objectstore import Location, TransferOptions
from disttrain.trainer.checkpoint.tiered import (
    IN_FLIGHT_PREFIX,
    BucketTier,
    PublishOptions,
    RecordingStore,
    record_key,
)
from disttrain.trainer.checkpoint.uploadprocess import CHILD_NICENESS, STARVED_WINDOW_S, RemoteStore, StoreRecipe
from disttrain.trainer.checkpoint.uploads import RetryPolicy, Uploader

pytestmark = pytest.mark.timeout(180)

FAST_RETRY = RetryPolicy(initial_s=0.2, max_s=0.5)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """A committed local checkpoint of step 4, large enough for multipart uploads (12 MiB in 5 MiB parts)."""
    root = tmp_path_factory.mktemp("local")
    store = dist.FileStore(str(root / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ckpt = CheckpointManager(root / "ckpt", CheckpointSpec(keep=1), 0, 1, dist.group.WORLD)
        ckpt.save(4, {"w": torch.randn(3 * 2**20, generator=torch.Generator().manual_seed(0))}, bare_manifest(4))
        ckpt.close()
    finally:
        dist.destroy_process_group()
    manifest = commit.validate(root / "ckpt" / "step-4").manifest
    assert manifest is not None
    return root / "ckpt" / "step-4", dict(manifest.files)


@pytest.fixture
def recipe(s3_server, s3_bucket, monkeypatch) -> StoreRecipe:
    """The bucket as a spec describes it; credentials in the environment, as the pod gets them."""
    for key, value in bucket_credentials(s3_server).items():
        monkeypatch.setenv(key, value)
    return StoreRecipe(
        location=Location(s3_bucket[1], "jobs/demo"),
        endpoint=s3_server.endpoint,
        region="us-east-1",
        addressing_style="path",
        transfer=TransferOptions(part_size=5 * 2**20, max_concurrency=4),
    )


def running(pid: int) -> bool:
    """Whether ``pid`` is a process that is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_uploads_run_in_a_low_priority_process_of_their_own_reused_for_every_upload(recipe, local, s3_bucket):
    client, bucket = s3_bucket
    directory, files = local
    store = recipe.committer()
    agreed = store.claim_round()
    uploader = Uploader(store, FAST_RETRY, RemoteStore(recipe))
    uploader.start()  # the process starts before the first save needs it
    deadline = time.monotonic() + 120
    while (uploader.process is None or uploader.process.pid is None) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert uploader.process is not None and uploader.process.pid is not None
    first = uploader.submit(4, directory, files, agreed)
    assert first.done.wait(120), first.last_error
    assert first.result is not None and all(d.etag for d in first.result.values())
    assert uploader.process is not None and uploader.process.pid is not None
    child = uploader.process.pid
    assert child != os.getpid() and parent_of(child) == os.getpid()
    assert os.getpriority(os.PRIO_PROCESS, child) == CHILD_NICENESS
    assert os.sched_getscheduler(child) == os.SCHED_IDLE
    for name, digest in first.result.items():
        head = client.head_object(Bucket=bucket, Key=f"jobs/demo/step-4/r{agreed}/{name}")
        assert head["ContentLength"] == digest.size and head["ETag"].strip('"') == digest.etag
    second = uploader.submit(6, directory, files, agreed)
    assert second.done.wait(120), second.last_error
    assert uploader.process.pid == child and uploader.process.starts == 1
    uploader.close()
    assert not running(child)


def test_an_upload_process_killed_in_an_upload_is_replaced_and_the_upload_completes(recipe, local, s3_bucket):
    """The child is SIGKILLed once its objects are in the bucket and before it records them (the ``uploaded``
    phase, which the child reports to this process and waits for): the attempt fails with the child's end, and the
    next one, in a new child, uploads and records the save."""
    client, bucket = s3_bucket
    directory, files = local
    store = recipe.committer()
    agreed = store.claim_round()
    seen: list[tuple[int, int, str]] = []  # (child pid, attempt, last error) at each phase

    def kill_the_first_child(phase: CheckpointPhase, step: int) -> None:
        assert phase is CheckpointPhase.UPLOADED and step == 4
        assert uploader.process is not None and uploader.process.pid is not None
        seen.append((uploader.process.pid, upload.attempts, upload.last_error))
        if len(seen) == 1:
            os.kill(uploader.process.pid, signal.SIGKILL)

    rank = 1
    remote = RemoteStore(dataclasses.replace(recipe, record_rank=rank), kill_the_first_child)
    uploader = Uploader(RecordingStore(store, rank, kill_the_first_child), FAST_RETRY, remote)
    upload = uploader.submit(4, directory, files, agreed)
    assert upload.done.wait(120), upload.last_error
    assert upload.result is not None and upload.attempts == 2 and not upload.last_error
    (killed, _, _), (replacement, attempt, error) = seen
    assert replacement != killed and attempt == 2 and f"the upload process {killed} ended (exit code -9)" in error
    assert not running(killed)  # reaped, not a zombie
    record = client.get_object(Bucket=bucket, Key=record_key(store, 4, agreed, rank))["Body"].read()
    assert {n: d["etag"] for n, d in json.loads(record).items()} == {n: d.etag for n, d in upload.result.items()}
    uploader.close()


def test_the_upload_process_ends_when_the_trainer_process_dies(recipe, local, tmp_path):
    """A trainer process SIGKILLed while its upload process is in the middle of an upload: the child ends too."""
    directory, files = local
    listing = json.dumps({n: d.model_dump() for n, d in files.items()})
    script = textwrap.dedent(
        f"""
        import json, os, signal, sys
        from pathlib import Path
        from disttrain.api.manifest import FileDigest
        from disttrain.trainer.checkpoint.objectstore import Location, TransferOptions
        from disttrain.trainer.checkpoint.tiered import RecordingStore
        from disttrain.trainer.checkpoint.uploadprocess import RemoteStore, StoreRecipe
        from disttrain.trainer.checkpoint.uploads import Uploader

        recipe = StoreRecipe(
            location=Location({recipe.location.bucket!r}, "jobs/demo"), endpoint={recipe.endpoint!r},
            region="us-east-1", addressing_style="path", record_rank=0,
        )
        def die(phase, step):
            print("child", uploader.process.pid, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        store = recipe.committer()
        uploader = Uploader(RecordingStore(store, 0, die), None, RemoteStore(recipe, die))
        files = {{n: FileDigest.model_validate(d) for n, d in json.loads({listing!r}).items()}}
        uploader.submit(4, Path({str(directory)!r}), files, 1).done.wait(120)
        sys.exit("the upload finished: the hook never ran")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=150)
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr[-3000:]
    child = int(done.stdout.split("child ")[1].split()[0])
    deadline = time.monotonic() + 30
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(child)


def test_where_no_upload_process_can_start_the_uploads_run_in_this_process(recipe, local, caplog):
    """A recipe that cannot be sent to a process (a class defined here cannot be pickled): a warning, and the
    upload runs in a thread of this process."""

    class Unpicklable(Location):
        pass

    directory, files = local
    store = recipe.committer()
    agreed = store.claim_round()
    broken = dataclasses.replace(recipe, location=Unpicklable(recipe.location.bucket, "jobs/demo"))
    uploader = Uploader(store, FAST_RETRY, RemoteStore(broken))
    with caplog.at_level(logging.WARNING, logger="disttrain.trainer"):
        upload = uploader.submit(4, directory, files, agreed)
        assert upload.done.wait(120), upload.last_error
    assert upload.result is not None and upload.attempts == 1 and uploader.process is None
    assert "checkpoint uploads run in the training process: no upload process here" in caplog.text
    uploader.close()


def test_local_retention_keeps_the_save_a_rank_of_the_tier_is_uploading(recipe, tmp_path):
    """Saves come faster than the uploads: the oldest local copies give way, except the one in flight, so that a
    bucket behind still gets a save."""
    root = tmp_path / "tier"
    root.mkdir()
    tier = BucketTier(recipe.committer(), root, 1, PublishOptions(keep=2, on_published=lambda manifest: None))
    try:
        tier.join_group(["node-a", "node-b"], 2)  # rank 1 leads its node's tier
        for step in (2, 4, 6, 8, 10):
            (root / f"step-{step}").mkdir()
        (root / f"{IN_FLIGHT_PREFIX}3").write_text("2")  # another rank of this node uploads step 2
        tier._retain_locally(10, local_round=1)
        tier.join_retention()
        assert sorted(p.name for p in root.glob("step-*")) == ["step-10", "step-2", "step-8"]  # 3 in all
        (root / f"{IN_FLIGHT_PREFIX}3").unlink()  # its upload ended
        (root / "step-12").mkdir()
        tier._retain_locally(12, local_round=1)
        tier.join_retention()
        assert sorted(p.name for p in root.glob("step-*")) == ["step-10", "step-12", "step-8"]
    finally:
        tier.close()


def pin(pid: int, cores: set[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cores)


def test_an_idle_upload_process_starved_while_saves_wait_is_replaced_by_one_out_of_the_idle_class(
    recipe, local, s3_server, s3_bucket, caplog
):
    """The upload process, in the idle class, shares its one core with two busy processes of normal priority (and
    with the gateway, without which an upload needs next to no CPU here) while two saves wait: a process out of the
    idle class replaces it, both saves are uploaded, and once nothing waits behind, the replacement moves into the
    idle class itself and stays the upload process."""
    directory, files = local
    store = recipe.committer()
    agreed = store.claim_round()
    uploader = Uploader(store, FAST_RETRY, RemoteStore(recipe))
    uploader.start()
    process = uploader.process
    assert process is not None
    deadline = time.monotonic() + 120
    while process.pid is None and time.monotonic() < deadline:
        time.sleep(0.1)
    starved = process.pid
    assert starved is not None and os.sched_getscheduler(starved) == os.SCHED_IDLE  # started before any save
    core = {min(os.sched_getaffinity(0))}
    busy = f"import os; os.sched_setaffinity(0, {core}); print('busy', flush=True)\nwhile True: pass"
    hogs = [subprocess.Popen([sys.executable, "-c", busy], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    gateway = s3_server._pid("client.rgw.a")
    assert gateway is not None
    gateway_cores = os.sched_getaffinity(gateway)
    try:
        assert all(hog.stdout is not None and hog.stdout.readline() == "busy\n" for hog in hogs)
        pin(starved, core)
        pin(gateway, core)
        with caplog.at_level(logging.INFO, logger="disttrain.trainer"):
            first = uploader.submit(4, directory, files, agreed)
            second = uploader.submit(6, directory, files, agreed)
            assert first.done.wait(120) and second.done.wait(120), (first.last_error, second.last_error)
        assert first.result is not None and second.result is not None
        assert process.replaced_starved >= 1 and process.pid != starved and not running(starved)
        assert f"process {starved} in the idle class gets no core: a new upload process at nice" in caplog.text
        replacement = process.pid
        assert f"checkpoint uploads run in process {replacement} (nice {CHILD_NICENESS})" in caplog.text
        # caught up once step 4 was uploaded: the replacement took step 6 in the idle class
        assert os.sched_getscheduler(replacement) == os.SCHED_IDLE
        assert os.getpriority(os.PRIO_PROCESS, replacement) == CHILD_NICENESS
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
            hog.stdout.close()  # type: ignore[union-attr]
        pin(gateway, gateway_cores)
    third = uploader.submit(8, directory, files, agreed)
    assert third.done.wait(120), third.last_error
    assert process.pid == replacement and process.starts == 2
    uploader.close()
    assert not running(replacement)


def test_an_upload_held_up_elsewhere_keeps_its_idle_process(recipe, local, s3_bucket):
    """Saves that wait behind an upload whose process is not short of a core (it waits on the trainer here, as it
    would on a slow bucket) do not replace it."""
    directory, files = local
    store = recipe.committer()
    agreed = store.claim_round()
    release = threading.Event()
    rank = 2

    def hold_the_first(phase: CheckpointPhase, step: int) -> None:
        if step == 4:
            assert release.wait(60)

    remote = RemoteStore(dataclasses.replace(recipe, record_rank=rank), hold_the_first)
    uploader = Uploader(RecordingStore(store, rank, hold_the_first), FAST_RETRY, remote)
    first = uploader.submit(4, directory, files, agreed)
    second = uploader.submit(6, directory, files, agreed)
    assert not first.done.wait(3 * STARVED_WINDOW_S)
    release.set()
    assert first.done.wait(120) and second.done.wait(120), (first.last_error, second.last_error)
    assert uploader.process is not None and uploader.process.starts == 1 and uploader.process.replaced_starved == 0
    uploader.close()
