"""Checkpoints in an S3 bucket against a real S3 server: upload throughput, the training step during an upload, and
resume from the bucket vs a volume.

    python bench/objectstore_throughput.py [--state-mb 128] [--repeats 3] [--part-mb 16] [--concurrency 8]
                                           [--step-batch 64] [--steps-during 40] [--no-pin]
                                           [--endpoint URL --access-key K --secret-key S]

Without ``--endpoint`` it starts a throwaway Ceph RADOS Gateway (tests/s3server.py, memstore OSD) on this machine,
and (unless ``--no-pin``) pins the gateway's processes to the last CPU and this process to the others: a job's
bucket is on other machines, so the server's CPU time should not be counted against the training step.

upload_vs_raw_put_ratio: the time of one multipart PUT of the same bytes as a single object (boto3's transfer
manager, the same part size and concurrency: the server's streaming rate), divided by the time the checkpoint
committer takes to upload a committed checkpoint's files, read each back (HEAD) and publish COMPLETE.json; medians
of ``--repeats``, alternating in this run.
step_during_upload_vs_idle: the median training step (forward, backward, AdamW on the same model, one torch thread)
while the trainer's background Uploader sends a committed checkpoint to the bucket through its upload process (as a
rank's BucketTier does: the process started before the save, the bucket described by a StoreRecipe, credentials in
the environment), divided by the median step with that process paused (SIGSTOP) in the middle of the same upload,
the two alternating step by step (ABBA): the machine's other load weighs on both alike. ``--repeats`` uploads, at
most ``--steps-during`` pairs each (in the idle class on the training's core the upload takes longer; it then
finishes untimed). The upload process inherits this process's CPU, so it competes with the training thread for its
one core: the worst case.
step_during_upload_on_a_spare_core_vs_idle: the same, with the upload process on the other core (the gateway's), as
on a node with a core the training thread does not use.
step_during_in_process_upload_vs_idle: the median step while the uploads run in threads of this process (the
fallback where no upload process can start), at most ``--steps-during`` steps, divided by the median of as many
steps right after the upload; alternating with the first in this run. On a machine that also runs the server, the
server's CPU time is in both figures.
resume_bucket_vs_volume: the time to resume a model + AdamW state from the bucket (find the newest trusted
checkpoint, download it, verify every byte, load it with DCP) divided by loading the same checkpoint from a local
volume (validate every digest, load).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.s3server: the throwaway gateway

import checkpoint_throughput as bench
from tests import s3server
from tests.manifests import bare_manifest

from disttrain.api.manifest import FileDigest
from disttrain.api.spec import CheckpointSpec
from disttrain.trainer.checkpoint import commit, storage
from disttrain.trainer.checkpoint import manager as ckpt_mod
from disttrain.trainer.checkpoint.objectstore import Location, ObjectStoreCommitter, TransferOptions
from disttrain.trainer.checkpoint.uploadprocess import RemoteStore, StoreRecipe
from disttrain.trainer.checkpoint.uploads import Uploader


def load_seconds(step_dir: Path, manifest_sha: str, state: dict) -> float:
    t0 = time.perf_counter()
    v = commit.validate(step_dir)
    assert v.ok, v.problem
    dcp.load(state, storage_reader=storage.CheckpointReader(str(step_dir), manifest_sha))
    return time.perf_counter() - t0


def pin_apart(server: s3server.RadosGateway) -> None:
    """The gateway's processes (every thread) on the last CPU, this process on the others."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return
    for name in ("client.rgw.a", "osd.0", "mon.a"):
        pid = server._pid(name)
        for tid in os.listdir(f"/proc/{pid}/task") if pid else []:
            os.sched_setaffinity(int(tid), {cpus[-1]})
    os.sched_setaffinity(0, set(cpus[:-1]))
    print(f"gateway on CPU {cpus[-1]}, this process on CPU {','.join(map(str, cpus[:-1]))}")


def timed_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    bench.train_step(model, opt, x)
    return time.perf_counter() - t0


def step_seconds_with_and_without_upload(
    train: tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor],
    uploader: Uploader,
    local: Path,
    step: int,
    max_steps: int,
) -> tuple[list[float], list[float]]:
    """Step times while ``uploader`` sends ``local``'s checkpoint as step ``step`` (at most ``max_steps``; the upload
    then finishes untimed), and as many right after with nothing uploading."""
    model, opt, x = train
    upload = uploader.submit(step, local, files_of(local), 1)
    during = []
    while not upload.done.is_set() and len(during) < max_steps:
        during.append(timed_step(model, opt, x))
    assert upload.done.wait(600) and upload.result is not None, upload.last_error
    return during, [timed_step(model, opt, x) for _ in during]


def paired_step_seconds(
    train: tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor],
    uploader: Uploader,
    local: Path,
    step: int,
    pairs: int,
    cpus: Optional[set[int]] = None,
) -> tuple[list[float], list[float]]:
    """Step times while ``uploader``'s upload process (on ``cpus``, else on this process's) sends ``local``'s
    checkpoint as step ``step``, paired with
    steps while that process is paused (SIGSTOP: nothing in flight) in the middle of the same upload, in the order
    ABBA so that a machine whose load drifts weighs on both alike; at most ``pairs`` pairs (the upload then
    finishes untimed)."""
    model, opt, x = train
    assert uploader.process is not None
    uploader.start()  # as a rank's BucketTier does: the process runs before the first save
    while uploader.process.pid is None:
        time.sleep(0.05)
    pid = uploader.process.pid
    if cpus:
        for tid in os.listdir(f"/proc/{pid}/task"):  # the threads it starts later inherit it
            os.sched_setaffinity(int(tid), cpus)
    upload = uploader.submit(step, local, files_of(local), 1)
    during: list[float] = []
    idle: list[float] = []
    try:
        while not upload.done.is_set() and len(during) < pairs:
            for paused in (False, True) if len(during) % 2 == 0 else (True, False):
                os.kill(pid, signal.SIGSTOP if paused else signal.SIGCONT)
                (idle if paused else during).append(timed_step(model, opt, x))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert upload.done.wait(600) and upload.result is not None, upload.last_error
    return during, idle


def files_of(local: Path) -> dict[str, FileDigest]:
    v = commit.validate(local)
    assert v.manifest is not None
    return dict(v.manifest.files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mb", type=float, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--part-mb", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--step-batch", type=int, default=64, help="samples of a training step (1024 wide)")
    parser.add_argument("--steps-during", type=int, default=40, help="steps (pairs) timed during one upload, at most")
    parser.add_argument("--no-pin", action="store_true", help="leave the local gateway on every CPU")
    parser.add_argument("--endpoint", default="")
    parser.add_argument("--access-key", default=s3server.ACCESS_KEY)
    parser.add_argument("--secret-key", default=s3server.SECRET_KEY)
    args = parser.parse_args()
    machine_cpus = os.sched_getaffinity(0)
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    dist.init_process_group("gloo", rank=0, world_size=1)
    server = None if args.endpoint else s3server.RadosGateway(memstore_bytes=4 * 2**30).__enter__()
    if server is not None and not args.no_pin:
        pin_apart(server)
    root = Path(tempfile.mkdtemp(prefix="s3-bench-"))
    try:
        import boto3
        from boto3.s3.transfer import TransferConfig, create_transfer_manager
        from botocore.config import Config

        client = boto3.client(
            "s3",
            endpoint_url=args.endpoint or server.endpoint,  # type: ignore[union-attr]
            aws_access_key_id=args.access_key,
            aws_secret_access_key=args.secret_key,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, max_pool_connections=args.concurrency + 2),
        )
        bucket = "bench-checkpoints"
        client.create_bucket(Bucket=bucket)
        transfer = TransferOptions(part_size=args.part_mb * 2**20, max_concurrency=args.concurrency)

        model, opt = bench.build(args.state_mb)
        bench.train_step(model, opt, torch.randn(256, 1024))
        state = {"app": ckpt_mod.ModelOptimState(model, opt), "trainer": ckpt_mod.TrainerState()}
        manager = ckpt_mod.CheckpointManager(root / "local", CheckpointSpec(keep=1), 0, 1, dist.group.WORLD)
        manager.save(1, state, bare_manifest(1))
        manager.close()
        local = root / "local" / "step-1"
        v = commit.validate(local)
        assert v.ok and v.manifest is not None
        nbytes = sum(f.size for f in v.manifest.files.values())
        blob = root / "blob"
        with open(blob, "wb") as out:
            for name in sorted(v.manifest.files):
                out.write((local / name).read_bytes())
        config = TransferConfig(
            multipart_threshold=transfer.part_size,
            multipart_chunksize=transfer.part_size,
            max_concurrency=transfer.max_concurrency,
        )
        files = len(v.manifest.files)
        print(f"state: {nbytes / 1e6:.1f} MB in {files} files; parts {args.part_mb} MiB x {args.concurrency}")

        ours, raw = [], []
        for r in range(args.repeats):
            committer = ObjectStoreCommitter(client, Location(bucket, f"run-{r}"), transfer=transfer)
            committer.claim_round()
            t0 = time.perf_counter()
            committer.publish(committer.upload(local, v.manifest))
            ours.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with create_transfer_manager(client, config) as transfers:
                transfers.upload(str(blob), bucket, f"raw-{r}").result()
            raw.append(time.perf_counter() - t0)
        ours_s, raw_s = statistics.median(ours), statistics.median(raw)
        print(
            f"checkpoint upload: median {ours_s:.3f} s ({nbytes / ours_s / 2**20:.0f} MiB/s); "
            f"raw multipart PUT: median {raw_s:.3f} s ({nbytes / raw_s / 2**20:.0f} MiB/s)"
        )
        print(f"upload_vs_raw_put_ratio: {raw_s / ours_s:.2f}")

        x = torch.randn(args.step_batch, 1024)
        for _ in range(3):
            timed_step(model, opt, x)
        os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = args.access_key, args.secret_key
        recipe = StoreRecipe(
            location=Location(bucket, "steps"),
            endpoint=args.endpoint or server.endpoint,  # type: ignore[union-attr]
            region="us-east-1",
            addressing_style="path",
            transfer=transfer,
        )
        store = recipe.committer()
        store.claim_round()
        spare = machine_cpus - os.sched_getaffinity(0)  # the gateway's core: a core training does not use
        uploaders = {  # one of each for the whole run, as a rank has
            "step_during_upload_vs_idle": Uploader(store, remote=RemoteStore(recipe)),
            "step_during_in_process_upload_vs_idle": Uploader(store),
        }
        if spare:
            uploaders["step_during_upload_on_a_spare_core_vs_idle"] = Uploader(store, remote=RemoteStore(recipe))
        times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in uploaders}
        for r in range(args.repeats):
            for i, (name, uploader) in enumerate(uploaders.items()):
                train, step = (model, opt, x), len(uploaders) * r + i + 1
                if uploader.process is None:
                    during, idle = step_seconds_with_and_without_upload(train, uploader, local, step, args.steps_during)
                else:
                    on = spare if "spare" in name else None
                    during, idle = paired_step_seconds(train, uploader, local, step, args.steps_during, on)
                times[name][0].extend(during)
                times[name][1].extend(idle)
        for uploader in uploaders.values():
            uploader.close()
        for name, (during, idle) in times.items():
            busy_s, idle_s = statistics.median(during), statistics.median(idle)
            print(
                f"training step ({name}): median {busy_s * 1e3:.1f} ms during an upload ({len(during)} steps), "
                f"{idle_s * 1e3:.1f} ms without"
            )
            print(f"{name}: {busy_s / idle_s:.3f}")

        bucket_s, volume_s = [], []
        for r in range(args.repeats):
            reader = ObjectStoreCommitter(client, Location(bucket, "run-0"), transfer=transfer)
            target = root / f"resume-{r}"
            t0 = time.perf_counter()
            found = reader.find_latest()
            assert found is not None
            path = reader.download(found, target)
            dcp.load(state, storage_reader=storage.CheckpointReader(str(path), found.manifest.metadata_sha256))
            bucket_s.append(time.perf_counter() - t0)
            volume_s.append(load_seconds(local, v.manifest.metadata_sha256, state))
            shutil.rmtree(target)
        from_bucket, from_volume = statistics.median(bucket_s), statistics.median(volume_s)
        print(f"resume from the bucket: median {from_bucket:.3f} s; from a volume: median {from_volume:.3f} s")
        print(f"resume_bucket_vs_volume: {from_bucket / from_volume:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if server is not None:
            server.stop()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
