"""Small models the Trainer tests share (imported by name: pytest puts this folder on ``sys.path``)."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fabric.trainer.core.callback import Callback


class Regressor(nn.Module):
    """A linear regressor on ``(x, y)`` batches with an MSE loss and a mean-absolute-error metric (eval only,
    unless ``mae_in_training``)."""

    def __init__(self, mae_in_training: bool = False) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.mae_in_training = mae_in_training

    def forward(self, batch: Any) -> torch.Tensor:
        return self.net(batch[0])

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.mse_loss(outputs, batch[1])

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        if is_train and not self.mae_in_training:
            return {}
        return {"mae": lambda outputs, batch: (outputs - batch[1]).abs().mean()}


class SigtermAtBatch(Callback):
    """Sends this process SIGTERM at the end of batch ``batch``, as a scheduler preempting the job would."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def batch_end(self, state: Any, logger: Any) -> None:
        if int(state.timestamp.batch) == self.batch:
            os.kill(os.getpid(), signal.SIGTERM)
