"""Step time of the example GPT on 2-D meshes against the 1-D FSDP2 mesh, side by side (gloo, CPU by default).

    python bench/mesh2d.py [--nproc 4] [--steps 20] [--width 128] [--layers 2] [--batch 16] [--device cpu|cuda]

Runs itself under ``torch.distributed.run --nproc-per-node=N``. In the same processes it builds three copies of
examples/gptlm's model, wrapped by the trainer's own :func:`disttrain.trainer.parallel.wrap`: FSDP2 over all N
ranks (1-D), HSDP (replicate N/2 x shard 2) and FSDP x TP (data N/2 x tensor 2, the example's TP plan). Each step
is one forward, backward and AdamW step on the same global batch of ``--batch`` sequences: N-way split on the 1-D
mesh and under HSDP, N/2-way under FSDP x TP (the ranks of a TP group read the same sequences). The three loops
run interleaved, step by step, so all see the same machine load. Prints the median step time of each and its
ratio to the 1-D one, as ``mesh2d_step_seconds`` JSON on the last line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
WARMUP = 3
VOCAB, HEADS, BLOCK = 64, 4, 64


def gptlm() -> Any:
    spec = importlib.util.spec_from_file_location("gptlm_train", REPO / "examples" / "gptlm" / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(case: str, args: argparse.Namespace, device: torch.device) -> tuple[Any, torch.optim.Optimizer, int, int]:
    """(model, optimizer, data degree, data rank) of one case, wrapped as the trainer wraps it."""
    from disttrain.api.spec import MeshSpec
    from disttrain.trainer import mesh, parallel
    from disttrain.trainer.options import ParallelOptions

    example = gptlm()
    torch.manual_seed(0)
    model = example.GPT(VOCAB, args.width, args.layers, HEADS, BLOCK).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    world, rank = dist.get_world_size(), dist.get_rank()
    spec = {"1-D": None, "HSDP": MeshSpec(shard=2), "FSDPxTP": MeshSpec(tensor_parallel=2)}[case]
    where = mesh.layout(spec, world)
    plan = example.TP_PLAN if case == "FSDPxTP" else None
    options = ParallelOptions(parallelism=parallel.Parallelism.FSDP2, tp_plan=plan)
    parallel.wrap(model, optimizer, device, options, parallel.Precision.FP32, layout=where)
    return model, optimizer, where.data_degree, where.data_rank(rank)


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cases = ["1-D", "HSDP", "FSDPxTP"]
    built = {case: build(case, args, device) for case in cases}
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (args.steps + WARMUP, args.batch, BLOCK + 1), generator=g)
    times: dict[str, list[float]] = {case: [] for case in cases}
    for i in range(args.steps + WARMUP):
        for case in cases:
            model, optimizer, degree, data_rank = built[case]
            batch = data[i, data_rank::degree].to(device)
            x, y = batch[:, :-1], batch[:, 1:]
            dist.barrier()
            start = time.perf_counter()
            loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
            if i >= WARMUP:
                times[case].append(float(elapsed))
    if dist.get_rank() == 0:
        medians = {case: statistics.median(t) for case, t in times.items()}
        print(f"{'mesh':<10} {'median step s':>14} {'vs 1-D':>8}")
        for case, median in medians.items():
            print(f"{case:<10} {median:>14.4f} {median / medians['1-D']:>8.3f}")
        result = {"nproc": dist.get_world_size(), "width": args.width, "layers": args.layers, "batch": args.batch}
        print(json.dumps({"mesh2d_step_seconds": medians, **result}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16, help="sequences per step, over all data ranks")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.nproc % 2 or args.batch % args.nproc:
        parser.error("--nproc must be even (TP and shard degree 2) and divide --batch")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    argv = [a for a in sys.argv[1:] if a != "--worker"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    raise SystemExit(subprocess.call([*cmd, __file__, *argv, "--worker"], env=env, cwd=REPO))


if __name__ == "__main__":
    main()
