"""Small models and data shared by the examples and the tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitrun.splitter import place, region


class TiedBigramLM(nn.Module):
    """A next-token model whose output head reuses the embedding table.

    Split three ways: the embedding on worker 0, the MLP on worker 1, the tied
    head on worker 2. The head reads the table that worker 0 owns and updates,
    so the table reaches worker 2 by data-sync every step; the loss runs on
    worker 0 (the default), so logits travel back from worker 2 to worker 0.
    """

    def __init__(self, vocab: int = 32, dim: int = 24, hidden: int = 48,
                 num_workers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim))
        self.norm = nn.LayerNorm(dim)
        self.num_workers = num_workers
        last = num_workers - 1
        place(self.embed, rank=0)
        place(self.mlp, rank=min(1, last))
        place(self.norm, rank=last)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(self.embed(tokens) + self.mlp(self.embed(tokens)))
        with region(rank=self.num_workers - 1):
            return hidden @ self.embed.weight.t()


def lm_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def markov_batches(num_steps: int, batch: int = 32, length: int = 16, vocab: int = 32,
                   seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token sequences from a fixed random Markov chain: next-token prediction
    has something to learn (the transition table), with a known floor."""
    generator = torch.Generator().manual_seed(seed)
    transitions = torch.softmax(3 * torch.randn(vocab, vocab, generator=generator), dim=-1)
    batches = []
    for _ in range(num_steps):
        tokens = torch.empty(batch, length + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab, (batch,), generator=generator)
        for t in range(length):
            tokens[:, t + 1] = torch.multinomial(transitions[tokens[:, t]], 1,
                                                 generator=generator).squeeze(1)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return batches
