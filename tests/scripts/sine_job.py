"""The small regression job the Trainer scripts under ``tests/scripts`` train (imported by name: a script's own
folder is on ``sys.path``): a dropout MLP fitting ``sin(sum(x))`` on 96 fixed samples."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 1))

    def forward(self, batch):
        return self.net(batch[0])

    def loss(self, outputs, batch):
        return F.mse_loss(outputs, batch[1])


def sine_data() -> TensorDataset:
    x = torch.randn(96, 6, generator=torch.Generator().manual_seed(1))
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
