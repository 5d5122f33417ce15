"""A user's own training program, shipped in an image built FROM the disttrain trainer image (see Dockerfile).

Fits a linear model to noisy synthetic data with the disttrain loop API; batch, LR, length and checkpoints come
from the worker contract the operator hands every worker (``$DISTTRAIN_CONTRACT``), see job.yaml.
"""

from __future__ import annotations

import torch

from disttrain.trainer.loop import ElasticTrainer


def dataset(samples: int = 512, features: int = 8) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)  # the same data on every rank and after every restart
    x = torch.randn(samples, features, generator=generator)
    w = torch.arange(1, features + 1, dtype=torch.float32)
    y = x @ w + 0.1 * torch.randn(samples, generator=generator)
    return torch.utils.data.TensorDataset(x, y.unsqueeze(1))


def main() -> None:
    data = dataset()
    torch.manual_seed(0)  # identical initial weights on every rank
    model = torch.nn.Linear(data.tensors[0].shape[1], 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with ElasticTrainer.from_env(model, optimizer, data, log_every=5) as trainer:
        for step in trainer.steps():
            for batch in step:
                x, y = batch.data
                step.backward(torch.nn.functional.mse_loss(trainer.model(x), y, reduction="sum"))


if __name__ == "__main__":
    main()
