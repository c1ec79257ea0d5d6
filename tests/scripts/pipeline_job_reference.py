"""The one-process reference of tests/scripts/pipeline_job.py: the same model, batches and steps, unsplit."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BATCH, STEPS, MAX_NORM = 8, 3, 0.5


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 6, generator=generator), torch.randn(BATCH, 3, generator=generator)) for _ in range(4)]


def run() -> dict[str, object]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, norms = [], []
    for inputs, targets in batches()[:STEPS]:
        loss = F.mse_loss(model(inputs), targets)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    inputs, targets = batches()[3]
    with torch.no_grad():
        output = model(inputs)
    weights = {name: value.detach().clone() for name, value in model.state_dict().items()}
    return {
        "losses": losses,
        "norms": norms,
        "weights": weights,
        "eval_loss": F.mse_loss(output, targets).item(),
        "eval_output": output,
    }
