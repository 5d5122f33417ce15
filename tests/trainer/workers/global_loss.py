"""A training script whose ranks see unequal token counts, with padding: the reported loss must be the global one.

Rank r has TOKENS[r] real tokens per step (spread over its micro batches, each padded to SEQ positions) and a loss
of PER_TOKEN[r] per real token; a padding position would add PADDING_LOSS if the script's mask did not drop it. The
token-weighted loss divides by ``step.global_count`` of the real tokens, so at world size 2 every step's loss is
(100 x 1 + 10 x 3) / 110 = 1.1818 and at world size 3 (+ 40 x 2) / 150 = 1.4; rank 0's own mean would be 1.
"""

from __future__ import annotations

import torch

from disttrain.trainer.loop import ElasticTrainer

TOKENS = (100, 10, 40)
PER_TOKEN = (1.0, 3.0, 2.0)
SEQ = 64
PADDING_LOSS = 100.0


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    dataset = torch.utils.data.TensorDataset(torch.ones(1000, 1))
    with ElasticTrainer.from_env(model, optimizer, dataset, log_every=1, device="cpu") as trainer:
        tokens, per_token = TOKENS[trainer.rank], PER_TOKEN[trainer.rank]
        for step in trainer.steps():
            accum = len(step.micro_indices)
            real = [tokens // accum + (1 if i < tokens % accum else 0) for i in range(accum)]
            denominator = step.global_count(sum(real))
            for i, batch in enumerate(step):
                (x,) = batch.data
                mask = torch.arange(SEQ) < real[i]
                per_position = torch.where(mask, per_token, PADDING_LOSS) + 0.0 * trainer.model(x).sum()
                step.backward((per_position * mask).sum(), denominator=denominator, count=int(mask.sum()))


if __name__ == "__main__":
    main()
