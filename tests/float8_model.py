"""The small language model the float8 tests train (imported by name: pytest puts ``tests/`` on ``sys.path``,
and tests/plugins/precision/test_float8.py puts it on ``PYTHONPATH`` for tests/scripts/float8_job.py): an embedding,
two pre-norm residual MLP blocks whose Linear layers float8 converts, and an output head it leaves in bf16 by
default."""

import torch
from torch import nn

#: The qualified names of the Linear layers fp8-mixed converts by default (every one but the head).
BODY_LAYERS = ["blocks.0.1", "blocks.0.3", "blocks.1.1", "blocks.1.3"]


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(2)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = hidden + block(hidden)
        return self.head(self.norm(hidden))
