"""The commit protocol on a real S3 server (Ceph RADOS Gateway, tests/s3server.py): what a reader trusts, fencing
by round with and without conditional writes, and retention.

Local checkpoints are written by a real CheckpointManager (one-process gloo group), uploaded and published by the
bucket committer, and read back by another committer (another group) into another directory, bit for bit. A save
stopped at each phase (some objects, all objects, no manifest) is never trusted; an object removed or replaced
after the commit makes its checkpoint untrusted and the previous one is chosen.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from tests.checkpoint_tensors import load_tensors
from tests.manifests import bare_manifest

from disttrain.api.spec import CheckpointSpec
from disttrain.trainer.checkpoint import commit
from disttrain.trainer.checkpoint.fence import FencedError
from disttrain.trainer.checkpoint.manager import CheckpointManager, ModelOptimState
from disttrain.trainer.checkpoint.objectstore import Location, ObjectStoreCommitter, TransferOptions, parse_uri
from disttrain.trainer.checkpoint.tiered import BucketTier, Publisher, PublishOptions, RecordingStore
from disttrain.trainer.checkpoint.uploads import RetryPolicy, Uploader

pytestmark = pytest.mark.timeout(180)

SMALL_PARTS = TransferOptions(part_size=5 * 2**20, max_concurrency=4)  # S3's smallest part: multipart above 5 MiB


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """Committed local checkpoints of steps 2, 4, 6 and 8 (steps 4 and 6 large enough for multipart uploads), each
    with a small model whose weight is the step."""
    root = tmp_path_factory.mktemp("local")
    store = dist.FileStore(str(root / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ckpt = CheckpointManager(root / "ckpt", CheckpointSpec(keep=5), 0, 1, dist.group.WORLD)
        g = torch.Generator().manual_seed(0)
        model = torch.nn.Linear(4, 3)
        app = ModelOptimState(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for step, n in ((2, 1000), (4, 3 * 2**20), (6, 3 * 2**20), (8, 1000)):
            with torch.no_grad():
                model.weight.fill_(float(step))
            ckpt.save(step, {"app": app, "w": torch.randn(n, generator=g), "step": step}, bare_manifest(step))
        ckpt.close()
    finally:
        dist.destroy_process_group()
    return root / "ckpt"


def committer(s3_bucket, **kwargs) -> ObjectStoreCommitter:
    client, bucket = s3_bucket
    return ObjectStoreCommitter(client, Location(bucket, "jobs/demo"), transfer=SMALL_PARTS, **kwargs)


def publish(c: ObjectStoreCommitter, local: Path, step: int) -> None:
    v = commit.validate(local / f"step-{step}")
    assert v.ok and v.manifest is not None
    c.publish(c.upload(local / f"step-{step}", v.manifest))


def test_a_published_checkpoint_is_found_by_a_new_group_and_downloads_bit_for_bit(s3_bucket, local, tmp_path):
    writer = committer(s3_bucket, job_uid="uid-1", node="a")
    assert writer.conditional_writes  # RGW refuses a second PUT If-None-Match: * of a key
    publish(writer, local, 2)
    publish(writer, local, 4)  # multipart: 12 MiB in 5 MiB parts
    reader = committer(s3_bucket, node="b")
    found = reader.find_latest()
    assert found is not None and (found.manifest.step, found.manifest.fence_round) == (4, 1)
    assert any("-" in d.etag for d in found.manifest.files.values() if d.etag), "no multipart upload was made"
    path = reader.download(found, tmp_path / "resume")
    assert path == tmp_path / "resume" / "step-4" and commit.validate(path).ok
    assert torch.equal(load_tensors(path, prefix="")["w"], load_tensors(local / "step-4", prefix="")["w"])
    assert reader.claim_round() == 2  # the reader's group claims above the writer's


def test_each_node_uploads_its_own_files_and_rank_0_publishes_what_every_rank_uploaded(s3_bucket, local, tmp_path):
    """Node-local disks: one node holds .metadata and the first shard file, another node the other shard file."""
    manifest = commit.validate(local / "step-4").manifest
    assert manifest is not None and len(manifest.files) >= 2
    names = sorted(manifest.files)
    mine = {n: manifest.files[n] for n in names if n in (commit.METADATA_FILE, "__0_0.distcp")}
    theirs = {n: d for n, d in manifest.files.items() if n not in mine}
    assert mine and theirs
    for node, files in (("node-0", mine), ("node-1", theirs)):
        (tmp_path / node).mkdir()
        for name in files:
            shutil.copy(local / "step-4" / name, tmp_path / node / name)
    rank0 = committer(s3_bucket, node="node-0")
    agreed = rank0.claim_round()
    rank1 = committer(s3_bucket, node="node-1")  # never claims: it uploads under the round rank 0 broadcast
    uploaded = rank0.upload_files(tmp_path / "node-0", 4, mine, agreed)
    with pytest.raises(ValueError, match="records every object's ETag"):
        rank0.publish(manifest.model_copy(update={"files": {**theirs, **uploaded}, "fence_round": agreed}))
    uploaded |= rank1.upload_files(tmp_path / "node-1", 4, theirs, agreed)
    rank0.publish(manifest.model_copy(update={"files": uploaded, "fence_round": agreed}))
    assert rank1.round is None and rank0.current_round() == agreed
    found = committer(s3_bucket).find_latest()
    assert found is not None and found.manifest.step == 4
    path = committer(s3_bucket).download(found, tmp_path / "resume")
    assert torch.equal(load_tensors(path, prefix="")["w"], load_tensors(local / "step-4", prefix="")["w"])


def test_a_save_stopped_at_any_phase_before_its_manifest_is_never_trusted(s3_bucket, local):
    c = committer(s3_bucket)
    publish(c, local, 2)
    manifest = commit.validate(local / "step-4").manifest
    assert manifest is not None
    partial = manifest.model_copy(update={"files": dict(list(manifest.files.items())[:1])})
    c.upload(local / "step-4", partial)  # killed after one object
    assert c.find_latest().manifest.step == 2
    uploaded = c.upload(local / "step-4", manifest)  # killed after every object, before COMPLETE.json
    assert c.find_latest().manifest.step == 2
    c.publish(uploaded)
    assert c.find_latest().manifest.step == 4


@pytest.mark.parametrize("damage", ["delete", "replace"])
def test_an_object_missing_or_replaced_after_the_commit_makes_the_older_checkpoint_the_newest_trusted(
    s3_bucket, local, damage
):
    client, bucket = s3_bucket
    c = committer(s3_bucket)
    publish(c, local, 2)
    publish(c, local, 4)
    key = f"jobs/demo/step-4/r1/{commit.METADATA_FILE}"
    if damage == "delete":
        client.delete_object(Bucket=bucket, Key=key)
    else:
        client.put_object(Bucket=bucket, Key=key, Body=b"x" * c.published()[0].manifest.files[".metadata"].size)
    newest = c.published()[0]
    assert newest.manifest.step == 4
    assert c.problem(newest).startswith(f"object {commit.METADATA_FILE} ")
    assert c.find_latest().manifest.step == 2


@pytest.mark.parametrize("conditional", [True, False])
def test_a_stale_group_cannot_publish_or_delete_and_its_late_commit_never_shadows(s3_bucket, local, conditional):
    old = committer(s3_bucket, node="old", conditional_writes=conditional)
    publish(old, local, 2)
    new = committer(s3_bucket, node="new", conditional_writes=conditional)
    assert new.claim_round() == 2
    manifest = commit.validate(local / "step-6").manifest
    with pytest.raises(FencedError, match="holds round 1, a newer group holds round 2"):
        old.publish(old.upload(local / "step-6", manifest))
    with pytest.raises(FencedError):
        old.retain(keep=1)
    # A stale group that passed its fence check just before the new group claimed publishes late, at a higher step.
    late = committer(s3_bucket, node="late", conditional_writes=conditional)
    uploaded = late.upload(local / "step-6", manifest)  # round 3
    newest = committer(s3_bucket, node="newest", conditional_writes=conditional)
    publish_newest = threading.Event()

    def the_newest_group_takes_over():
        assert newest.claim_round() == 4
        publish(newest, local, 4)
        publish_newest.set()

    late.publish(uploaded, on_before_manifest=the_newest_group_takes_over)
    assert publish_newest.is_set()
    found = newest.find_latest()
    assert (found.manifest.step, found.manifest.fence_round) == (4, 4)  # not the late step 6 of round 3
    assert [p.manifest.order for p in newest.published()] == [(4, 4), (3, 6), (1, 2)]


def test_without_conditional_writes_concurrent_claimers_get_distinct_rounds(s3_bucket):
    claimers = [committer(s3_bucket, node=f"n{i}", conditional_writes=False) for i in range(4)]
    rounds: list[int] = []
    threads = [threading.Thread(target=lambda c=c: rounds.append(c.claim_round())) for c in claimers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(rounds) == sorted(set(rounds)) and len(rounds) == 4


def test_retention_deletes_only_behind_a_newer_trusted_checkpoint_and_spares_a_newer_rounds_upload(s3_bucket, local):
    client, bucket = s3_bucket
    c = committer(s3_bucket)
    publish(c, local, 2)
    c.upload(local / "step-4", commit.validate(local / "step-4").manifest)  # abandoned: a newer save is COMPLETE
    publish(c, local, 6)
    manifest8 = commit.validate(local / "step-8").manifest
    # Newer than the newest COMPLETE: it may still be uploading, its objects arriving from other ranks before rank
    # 0's publisher hears of the save, so no in-flight list can name it yet. Kept.
    c.upload(local / "step-8", manifest8)
    assert c.retain(keep=1) == ["step-2/r1", "step-4/r1"]
    assert [p.key_prefix for p in c.published()] == ["step-6/r1"]
    assert any(k["Key"].startswith("jobs/demo/step-8/r1/") for k in client.list_objects_v2(Bucket=bucket)["Contents"])
    # The newest checkpoint damaged: nothing older is deleted for it (it is not trusted).
    c.publish(c.upload(local / "step-8", manifest8))
    client.delete_object(Bucket=bucket, Key="jobs/demo/step-8/r1/" + commit.METADATA_FILE)
    assert c.retain(keep=1) == ["step-8/r1"] and c.find_latest().manifest.step == 6
    manifest6 = commit.validate(local / "step-6").manifest
    # A newer group's save in flight is not this group's to delete, and this group is fenced anyway.
    newer = committer(s3_bucket)
    newer.upload(local / "step-6", manifest6)
    assert newer.claim_round() == 2 and c.published()
    with pytest.raises(FencedError):
        c.retain(keep=1)
    assert newer.retain(keep=1, in_flight=["step-6/r2"]) == []
    assert any(k["Key"].startswith("jobs/demo/step-6/r2/") for k in client.list_objects_v2(Bucket=bucket)["Contents"])


@pytest.mark.parametrize(
    "uri, problem",
    [
        ("s3:/bucket", "is not an s3://BUCKET/PREFIX URI"),
        ("gs://bucket/x", "the scheme gs:// is not supported"),
        ("s3://Bucket/x", "the bucket 'Bucket' is not an S3 bucket name"),
        ("s3://bucket/a//b", "empty, '.' or '..' segment"),
        ("s3://bucket/a/../b", "empty, '.' or '..' segment"),
    ],
)
def test_a_malformed_uri_is_refused_saying_why(uri, problem):
    with pytest.raises(ValueError, match=problem.replace(".", r"\.").replace("'", "'")):
        parse_uri(uri)


def test_a_uri_names_the_bucket_and_the_prefix():
    assert parse_uri("s3://my-bucket/jobs/demo/") == Location("my-bucket", "jobs/demo")
    assert parse_uri("s3://my-bucket") == Location("my-bucket", "")
    assert Location("b", "").key("step-1", "x") == "step-1/x" and Location("b", "p").key("f") == "p/f"


def test_disttrain_export_reads_the_newest_trusted_checkpoint_of_a_bucket(s3_server, s3_bucket, local, tmp_path):
    """Through the CLI (a process of its own), credentials from the environment as boto3 reads them."""
    client, bucket = s3_bucket
    c = committer(s3_bucket)
    publish(c, local, 2)
    publish(c, local, 4)
    client.delete_object(Bucket=bucket, Key="jobs/demo/step-4/r1/" + commit.METADATA_FILE)  # step 4 not trusted
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    cmd = [sys.executable, "-m", "disttrain.operator.cli", "export", f"s3://{bucket}/jobs/demo", str(tmp_path / "out")]
    done = subprocess.run(
        [*cmd, "--endpoint-url", s3_server.endpoint, "--addressing-style", "path"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(exported["weight"], torch.full((3, 4), 2.0))  # step 2's: step 4 lost an object
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]  # no download left
    bad = subprocess.run(
        [*cmd, "--endpoint-url", s3_server.endpoint, "--addressing-style", "path"],
        env={**env, "AWS_SECRET_ACCESS_KEY": "wrong"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "SignatureDoesNotMatch" in bad.stderr, bad.stderr[-2000:]


def test_an_unreachable_bucket_delays_the_upload_never_the_caller_and_it_completes_once_back(
    s3_server, s3_bucket, local
):
    c = committer(s3_bucket)
    agreed = c.claim_round()
    manifest = commit.validate(local / "step-4").manifest
    uploader = Uploader(c, RetryPolicy(initial_s=0.2, max_s=0.5))
    s3_server.stop_gateway()
    try:
        upload = uploader.submit(4, local / "step-4", manifest.files, agreed)  # returns while the store is down
        assert not upload.done.is_set() and uploader.pending() == [upload]
        deadline = time.monotonic() + 60
        while upload.attempts < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert upload.attempts >= 2 and "Could not connect" in upload.last_error, upload.last_error
        assert not upload.done.is_set()
    finally:
        s3_server.start_gateway()
    assert upload.done.wait(60), upload.last_error
    assert upload.result is not None and all(d.etag for d in upload.result.values()) and not upload.last_error
    assert uploader.pending() == []
    uploader.close()
    c.publish(manifest.model_copy(update={"files": upload.result, "fence_round": agreed}))
    assert c.find_latest().manifest.step == 4


def test_the_publisher_completes_a_save_only_once_every_rank_recorded_uploads_matching_its_manifest(
    s3_bucket, local, tmp_path
):
    """Two ranks on two nodes each upload their part (tiered.RecordingStore); rank 0's Publisher writes COMPLETE.json
    only once both records are in and they match the manifest; a record that does not match never completes."""
    manifest = commit.validate(local / "step-4").manifest
    assert manifest is not None
    names = sorted(manifest.files)
    parts = [{n: manifest.files[n] for n in names[:1]}, {n: manifest.files[n] for n in names[1:]}]
    c = committer(s3_bucket)
    agreed = c.claim_round()
    published: list = []
    publisher = Publisher(c, 2, PublishOptions(3, published.append, RetryPolicy(initial_s=0.2, max_s=0.5)))
    publisher.submit(manifest.model_copy(update={"fence_round": agreed}))
    RecordingStore(c, 0).upload_files(local / "step-4", 4, parts[0], agreed)
    assert c.find_latest() is None  # rank 1's part is not recorded: no COMPLETE, however long one waits
    RecordingStore(committer(s3_bucket), 1).upload_files(local / "step-4", 4, parts[1], agreed)
    assert publisher.wait_idle(60), publisher.last_error
    found = c.find_latest()
    assert found is not None and found.manifest.step == 4 and [m.step for m in published] == [4]
    assert all(d.etag for d in found.manifest.files.values())

    manifest6 = commit.validate(local / "step-6").manifest
    assert manifest6 is not None
    wrong = {n: d.model_copy(update={"digest": "crc32:00000000"}) for n, d in manifest6.files.items()}
    publisher.submit(manifest6.model_copy(update={"files": wrong, "fence_round": agreed}))
    RecordingStore(c, 0).upload_files(local / "step-6", 6, dict(manifest6.files), agreed)
    RecordingStore(c, 1).upload_files(local / "step-6", 6, {}, agreed)  # a rank that wrote no file records too
    deadline = time.monotonic() + 60
    while "do not match" not in publisher.last_error and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "upload records do not match its manifest" in publisher.last_error
    assert c.find_latest().manifest.step == 4
    publisher.close()


def test_the_backlog_names_the_saves_waiting_for_the_bucket_and_why_until_it_is_back(
    s3_server, s3_bucket, local, tmp_path
):
    """What rank 0 reports as status.checkpointUpload while the gateway is stopped, and nothing once it caught up."""
    shutil.copytree(local, tmp_path / "tier")
    c = committer(s3_bucket)
    agreed = c.claim_round()
    tier = BucketTier(c, tmp_path / "tier", 0, PublishOptions(3, lambda m: None, RetryPolicy(initial_s=0.2, max_s=0.5)))
    tier.join_group(["this-node"], 1)
    assert tier.backlog() is None
    s3_server.stop_gateway()
    try:
        for step in (2, 4):
            manifest = commit.validate(tmp_path / "tier" / f"step-{step}").manifest
            assert manifest is not None
            tier.after_local_commit(manifest.model_copy(update={"fence_round": agreed}), dict(manifest.files), 1)
        deadline = time.monotonic() + 60
        while "Could not connect" not in (tier.backlog() or "") and time.monotonic() < deadline:
            time.sleep(0.1)
        backlog = tier.backlog() or ""
        assert (
            backlog.startswith("2 save(s) not yet COMPLETE in the bucket (oldest step-2): ") and "Could not" in backlog
        )
    finally:
        s3_server.start_gateway()
    assert tier.flush(60)
    assert tier.backlog() is None and c.find_latest().manifest.step == 4
    tier.close()


def test_a_tier_that_holds_the_checkpoint_reads_it_from_disk_and_only_the_others_download(s3_bucket, local, tmp_path):
    """A resume from the bucket on two nodes, one of which kept its local copy of the chosen checkpoint: that node
    gets no object from the bucket, the other downloads every one; both end with the same verified checkpoint."""
    c = committer(s3_bucket)
    publish(c, local, 4)
    found = c.find_latest()
    assert found is not None
    kept, fresh = tmp_path / "kept", tmp_path / "fresh"
    shutil.copytree(local / "step-4", kept / "step-4")
    gets: list[str] = []
    for root in (kept, fresh):
        reader = committer(s3_bucket)
        reader.client.meta.events.register(
            "before-parameter-build.s3.GetObject", lambda params, **_: gets.append(params["Key"])
        )
        tier = BucketTier(reader, root, 0, PublishOptions(3, lambda m: None))
        assert tier.download(found) == root / "step-4"
        if root is kept:
            assert gets == []
    assert {k.rsplit("/", 1)[1] for k in gets} == set(found.manifest.files)  # ranged GETs for the large ones
    for root in (kept, fresh):
        assert commit.validate(root / "step-4").ok
        assert torch.equal(
            load_tensors(root / "step-4", prefix="")["w"], load_tensors(local / "step-4", prefix="")["w"]
        )
