"""What the real-GPU tests share: a small model, its data, a plain PyTorch training loop as the reference, and
``benchmarks/gpu.py``'s table of peak FLOP/s (imported by name: pytest puts this folder on ``sys.path``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[2]
STEPS, LR = 8, 0.5  # enough SGD steps that the weights move well beyond every precision's tolerance


def make_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def regression_data(device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """256 inputs and smooth targets, the same on every call."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=generator)
    return x.to(device), torch.sin(2 * x[:, :4]).to(device)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The regression loss, in the output's dtype (float64 under ``64-true``)."""
    return F.mse_loss(output, target.to(output.dtype))


def train(
    model: Callable[[torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    backward: Callable[[torch.Tensor], None] | None = None,
    steps: int = STEPS,
) -> list[float]:
    """``steps`` full-batch steps; ``backward`` is ``fabric.backward`` for a set-up model. Returns the losses."""
    losses = []
    for _ in range(steps):
        loss = mse(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        if backward is None:
            loss.backward()  # type: ignore[no-untyped-call]
        else:
            backward(loss)
        optimizer.step()
        losses.append(loss.item())
    return losses


def full_parameters(module: nn.Module) -> list[torch.Tensor]:
    """A copy of every parameter as one whole float32 tensor on the CPU (a DTensor shard gathered first)."""
    tensors = []
    for parameter in module.parameters():
        tensor = parameter.full_tensor() if isinstance(parameter, DTensor) else parameter
        tensors.append(tensor.detach().to("cpu", torch.float32, copy=True))
    return tensors


def max_difference(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))
