"""Train a GPT-style character LM with FSDP2 and bf16 on the tinylm corpus, with the disttrain loop API.

The model is a stack of pre-norm causal self-attention blocks in an ``nn.ModuleList``, so the trainer's default
FSDP2 wrapping shards each block and then the root (embeddings and head), as TorchTitan does. ``--size`` picks
the model: ``small`` (default, trains on a CPU in a minute), ``medium`` or ``large`` (for GPUs). Settings (batch,
LR, length, checkpoints) come from the worker contract like any disttrain program; run directly without one, it
takes the contract of ``examples/jobs/tinylm.yaml`` and checkpoints under ``./runs/gptlm``:
``torchrun --nproc-per-node=2 examples/gptlm/train.py``.

On a job whose ``spec.training.mesh.tensorParallel`` is set, the attention and MLP of every block are split over the
TP group with :data:`TP_PLAN` (FSDP x TP); ``--tensor-parallel K`` declares that mesh on a plain run.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

if TYPE_CHECKING:
    from disttrain.api.spec import MeshSpec

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parent / "tinylm" / "corpus.txt"
SIZES = {  # d_model, layers, heads, block
    "small": (64, 2, 4, 64),
    "medium": (512, 8, 8, 256),
    "large": (2048, 24, 16, 1024),
}
TP_PLAN: dict[str, ParallelStyle] = {
    "blocks.*.qkv": ColwiseParallel(),  # whole heads per rank: the fused weight is laid out head by head
    "blocks.*.proj": RowwiseParallel(),
    "blocks.*.mlp.0": ColwiseParallel(),
    "blocks.*.mlp.2": RowwiseParallel(),
}
"""Megatron's split of each block (TorchTitan's ``apply_tp``): the heads' q, k, v and the MLP's first layer by output
column, the attention projection and the MLP's second layer by input row, so each block needs one all-reduce in its
forward and one in its backward. Norms, embeddings and the head stay whole on every TP rank."""


def default_contract_env(tensor_parallel: int = 0) -> None:
    """Plain runs: read the tinylm job manifest (the operator sets these variables itself), with a TP mesh of
    ``tensor_parallel`` ranks when it is above 0."""
    if os.environ.get("DISTTRAIN_CONTRACT"):
        return
    import yaml

    from disttrain.api.contract import WorkerContract
    from disttrain.api.spec import DistTrainJob

    manifest = yaml.safe_load((HERE.parent / "jobs" / "tinylm.yaml").read_text())
    if tensor_parallel:
        manifest["spec"]["training"]["mesh"] = {"tensorParallel": tensor_parallel}
    job = DistTrainJob.model_validate(manifest)
    os.environ["DISTTRAIN_CONTRACT"] = WorkerContract.from_spec(job.spec).to_env_value()
    os.environ.setdefault("DISTTRAIN_CHECKPOINT_DIR", str(Path("runs") / "gptlm"))


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP; one FSDP2 unit. The forward reads the head count from the width of
    ``qkv``'s output, so it runs unchanged on a TP rank that holds some of the heads."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.head_dim = d_model // heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, -1, 3, self.head_dim).unbind(3)  # per head: its q, k, v
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, block: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(block, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build_dataset(block: int) -> tuple[torch.utils.data.TensorDataset, int]:
    text = CORPUS.read_text()
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    starts = torch.arange(0, len(ids) - block - 1, block // 2)
    x = torch.stack([ids[s : s + block] for s in starts])
    y = torch.stack([ids[s + 1 : s + block + 1] for s in starts])
    return torch.utils.data.TensorDataset(x, y), len(chars)


def trainer_mesh() -> Optional[MeshSpec]:
    """The job's ``spec.training.mesh``, from the worker contract."""
    from disttrain.api.contract import WorkerContract

    return WorkerContract.from_env_value(os.environ["DISTTRAIN_CONTRACT"]).training.mesh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
    parser.add_argument("--clip", type=float, default=1.0, help="max global gradient norm (0: no clipping)")
    parser.add_argument(
        "--tensor-parallel", type=int, default=0, help="plain runs: declare an FSDP x TP mesh of this TP degree"
    )
    args = parser.parse_args()
    default_contract_env(args.tensor_parallel)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))

    from disttrain.trainer.loop import ElasticTrainer

    d_model, layers, heads, block = SIZES[args.size]
    dataset, vocab = build_dataset(block)
    torch.manual_seed(0)  # identical initial weights on every rank; the checkpoint takes over after a restart
    model = GPT(vocab, d_model, layers, heads, block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, betas=(0.9, 0.95))
    options: dict[str, Any] = {"parallelism": "fsdp2", "precision": args.precision, "clip_grad_norm": args.clip or None}
    mesh = trainer_mesh()
    if mesh is not None and mesh.tensor_parallel:
        options["tp_plan"] = TP_PLAN
    with ElasticTrainer.from_env(model, optimizer, dataset, log_every=20, **options) as trainer:
        if trainer.rank == 0:
            layout = f"FSDP x TP{mesh.tensor_parallel}" if "tp_plan" in options and mesh else "FSDP2"
            print(
                f"gptlm ({args.size}, {layout}, {args.precision}): {sum(p.numel() for p in model.parameters())} "
                f"parameters, vocab {vocab}; uniform loss would be {math.log(vocab):.2f}",
                flush=True,
            )
        for step in trainer.steps():
            tokens = step.global_count(sum(len(mb) for mb in step.micro_indices) * block)
            for batch in step:
                x, y = batch.data
                logits = trainer.model(x)
                loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1), reduction="sum")
                step.backward(loss, denominator=tokens, count=y.numel())
        if trainer.device.type == "cuda" and trainer.rank == 0:  # read by bench/gpu_smoke.py
            print(f"max_memory_allocated_gb: {torch.cuda.max_memory_allocated() / 2**30:.3f}", flush=True)


if __name__ == "__main__":
    main()
