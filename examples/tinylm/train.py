"""Train a tiny character-level transformer LM on corpus.txt with the disttrain loop API.

Settings (batch, LR, length, checkpoints) come from the worker contract in ``$DISTTRAIN_CONTRACT`` like any
disttrain program, so the same script runs under the operator, ``disttrain local`` and torchrun. Run directly
without a contract, it takes the contract from ``examples/jobs/tinylm.yaml`` and checkpoints under
``./runs/tinylm`` (``python examples/tinylm/train.py``, or ``torchrun --nproc-per-node=2 examples/tinylm/train.py``).

The model has no dropout, so there is no randomness to key; see ``disttrain.trainer.randomness`` for a model
that needs it. The loss is token-weighted: summed over tokens, divided by the step's global token count.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent


def default_contract_env() -> None:
    """Plain runs: read the job manifest next door (the operator sets these variables itself)."""
    if os.environ.get("DISTTRAIN_CONTRACT"):
        return
    import yaml

    from disttrain.api.contract import WorkerContract
    from disttrain.api.spec import DistTrainJob

    job = DistTrainJob.model_validate(yaml.safe_load((HERE.parent / "jobs" / "tinylm.yaml").read_text()))
    os.environ["DISTTRAIN_CONTRACT"] = WorkerContract.from_spec(job.spec).to_env_value()
    os.environ.setdefault("DISTTRAIN_CHECKPOINT_DIR", str(Path("runs") / "tinylm"))


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, block: int) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Embedding(block, d_model)
        layer = torch.nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(block), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def build_dataset(block: int) -> tuple[torch.utils.data.TensorDataset, int]:
    text = (HERE / "corpus.txt").read_text()
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    starts = torch.arange(0, len(ids) - block - 1, block // 2)
    x = torch.stack([ids[s : s + block] for s in starts])
    y = torch.stack([ids[s + 1 : s + block + 1] for s in starts])
    return torch.utils.data.TensorDataset(x, y), len(chars)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block", type=int, default=64)
    args = parser.parse_args()
    default_contract_env()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))

    from disttrain.trainer.loop import ElasticTrainer

    dataset, vocab = build_dataset(args.block)
    torch.manual_seed(0)  # identical initial weights on every rank; the checkpoint takes over after a restart
    model = TinyLM(vocab, args.d_model, args.layers, args.heads, args.block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, betas=(0.9, 0.95))
    with ElasticTrainer.from_env(model, optimizer, dataset, log_every=20) as trainer:
        if trainer.rank == 0:
            print(
                f"tinylm: {sum(p.numel() for p in model.parameters())} parameters, vocab {vocab}, "
                f"{len(dataset)} windows of {args.block}; uniform loss would be {math.log(vocab):.2f}",
                flush=True,
            )
        for step in trainer.steps():
            tokens = step.global_count(sum(len(mb) for mb in step.micro_indices) * args.block)
            for batch in step:
                x, y = batch.data
                logits = trainer.model(x)
                loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1), reduction="sum")
                step.backward(loss, denominator=tokens, count=y.numel())


if __name__ == "__main__":
    main()
