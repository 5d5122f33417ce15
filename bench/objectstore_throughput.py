"""Checkpoints in an S3 bucket against a real S3 server: upload throughput, the training step during an upload, and
resume from the bucket vs a volume.

    python bench/objectstore_throughput.py [--state-mb 128] [--repeats 3] [--part-mb 16] [--concurrency 8]
                                           [--step-batch 64] [--no-pin] [--endpoint URL --access-key K --secret-key S]

Without ``--endpoint`` it starts a throwaway Ceph RADOS Gateway (tests/s3server.py, memstore OSD) on this machine,
and (unless ``--no-pin``) pins the gateway's processes to the last CPU and this process to the others: a job's
bucket is on other machines, so the server's CPU time should not be counted against the training step.

upload_vs_raw_put_ratio: the time of one multipart PUT of the same bytes as a single object (boto3's transfer
manager, the same part size and concurrency: the server's streaming rate), divided by the time the checkpoint
committer takes to upload a committed checkpoint's files, read each back (HEAD) and publish COMPLETE.json; medians
of ``--repeats``, alternating in this run.
step_during_upload_vs_idle: the median training step (forward, backward, AdamW on the same model, one torch thread)
while the trainer's background Uploader sends a committed checkpoint to the bucket, divided by the median of as
many steps with no upload, run right after it; ``--repeats`` uploads. On a machine that also runs the server, the
server's CPU time is in it.
resume_bucket_vs_volume: the time to resume a model + AdamW state from the bucket (find the newest trusted
checkpoint, download it, verify every byte, load it with DCP) divided by loading the same checkpoint from a local
volume (validate every digest, load).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.s3server: the throwaway gateway

import checkpoint_throughput as bench
from tests import s3server
from tests.manifests import bare_manifest

from disttrain.api.spec import CheckpointSpec
from disttrain.trainer.checkpoint import commit, storage
from disttrain.trainer.checkpoint import manager as ckpt_mod
from disttrain.trainer.checkpoint.objectstore import Location, ObjectStoreCommitter, TransferOptions
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
    model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, stores: list[ObjectStoreCommitter], local: Path
) -> tuple[list[float], list[float]]:
    """Step times while each store receives ``local``'s checkpoint from a background Uploader, and as many right
    after with nothing uploading."""
    v = commit.validate(local)
    assert v.manifest is not None
    during, idle = [], []
    for store in stores:
        agreed = store.claim_round()
        uploader = Uploader(store)
        upload = uploader.submit(1, local, dict(v.manifest.files), agreed)
        steps = []
        while not upload.done.is_set():
            steps.append(timed_step(model, opt, x))
        uploader.close()
        assert upload.result is not None, upload.last_error
        during += steps
        idle += [timed_step(model, opt, x) for _ in steps]
    return during, idle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mb", type=float, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--part-mb", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--step-batch", type=int, default=64, help="samples of a training step (1024 wide)")
    parser.add_argument("--no-pin", action="store_true", help="leave the local gateway on every CPU")
    parser.add_argument("--endpoint", default="")
    parser.add_argument("--access-key", default=s3server.ACCESS_KEY)
    parser.add_argument("--secret-key", default=s3server.SECRET_KEY)
    args = parser.parse_args()
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
        stores = [
            ObjectStoreCommitter(client, Location(bucket, f"steps-{r}"), transfer=transfer) for r in range(args.repeats)
        ]
        during, idle = step_seconds_with_and_without_upload(model, opt, x, stores, local)
        busy_s, idle_s = statistics.median(during), statistics.median(idle)
        print(
            f"training step: median {busy_s * 1e3:.1f} ms during an upload ({len(during)} steps), "
            f"{idle_s * 1e3:.1f} ms without"
        )
        print(f"step_during_upload_vs_idle: {busy_s / idle_s:.3f}")

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
