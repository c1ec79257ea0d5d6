"""The data and model both benchmark jobs train on, defined once so their work is provably the same."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

SEED = 1234
SIZES = (32, 64, 10)
BATCH_SIZE = 64
BATCHES_PER_EPOCH = 50  # per rank


def make_dataset(world_size: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(SEED)
    samples = BATCH_SIZE * BATCHES_PER_EPOCH * world_size
    features = torch.randn(samples, SIZES[0], generator=generator)
    targets = torch.randint(0, SIZES[-1], (samples,), generator=generator)
    return TensorDataset(features, targets)


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(SIZES[0], SIZES[1]), nn.ReLU(), nn.Linear(SIZES[1], SIZES[2]))
