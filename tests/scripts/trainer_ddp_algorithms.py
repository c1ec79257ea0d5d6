"""Algorithms on DDP: ``python trainer_ddp_algorithms.py OUT_DIR DEVICES MODE``; each rank saves what it computed.

``MODE="exact"``: GradientClipping (norm), EMA, LabelSmoothing and LayerFreezing (per batch, which needs DDP's
``find_unused_parameters=True`` once layers stop receiving gradients). All four are deterministic given the global
batch, so 2 ranks (8 samples each) must reach the weights of 1 process on the full batch of 16.
``MODE="mixed"``: precision ``16-mixed`` (fp16 autocast + GradScaler) with MixUp (its draws come from the seeded
global generator, so every rank mixes alike), GradientClipping (norm) and EMA; records the gradient norm every
step right after the clipping (a callback at AFTER_TRAIN_BATCH runs after the algorithms).
"""

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric.strategies.ddp import DDPStrategy
from fabric.trainer.algorithms import EMA, GradientClipping, LabelSmoothing, LayerFreezing, MixUp
from fabric.trainer.core.callback import Callback
from fabric.trainer.core.state import State
from fabric.trainer.trainer import Trainer

out_dir, devices, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
THRESHOLD = 0.3


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, batch: Any) -> torch.Tensor:
        return self.net(batch[0])  # type: ignore[no-any-return]

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.cross_entropy(outputs, batch[1])  # takes the soft targets LabelSmoothing and MixUp make


class GradientNorms(Callback):
    def __init__(self) -> None:
        self.norms: list[float] = []

    def after_train_batch(self, state: State, logger: Any) -> None:
        grads = [p.grad for p in state.model.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))


@torch.no_grad()
def full_data_loss(model: nn.Module) -> float:
    return F.cross_entropy(model((x, y)), y).item()


torch.manual_seed(0)
model = Classifier()
x = torch.randn(64, 6, generator=torch.Generator().manual_seed(1))
y = (x[:, 0] > 0).long() + (x[:, 1] + x[:, 2] > 0).long()
loss_before = full_data_loss(model)
ema, norms = EMA(half_life="2ba"), GradientNorms()
if mode == "exact":
    algorithms = [GradientClipping("norm", THRESHOLD), ema, LabelSmoothing(0.1), LayerFreezing(0.5, 0.7, "batch")]
    strategy = DDPStrategy(find_unused_parameters=True) if devices > 1 else "auto"
    precision = "32-true"
else:
    algorithms = [MixUp(alpha=0.4), GradientClipping("norm", THRESHOLD), ema]
    strategy, precision = "ddp" if devices > 1 else "auto", "16-mixed"
trainer = Trainer(
    model=model,
    train_dataloader=DataLoader(TensorDataset(x, y), batch_size=16 // devices),
    max_duration="4ep",
    optimizers=torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
    algorithms=algorithms,
    callbacks=[norms],
    precision=precision,
    progress_bar=False,
    seed=0,
    accelerator="cpu",
    strategy=strategy,
    devices=devices,
)
trainer.fit()
out_dir.mkdir(parents=True, exist_ok=True)
torch.save(
    {
        "params": [p.detach() for p in model.parameters()],
        "ema": ema.averages,
        "frozen": [not p.requires_grad for p in model.parameters()],
        "norms": norms.norms,
        "loss_before": loss_before,
        "loss_after": full_data_loss(model),
        "batches": int(trainer.state.timestamp.batch),
        "world_size": trainer.fabric.world_size,
    },
    out_dir / f"rank{trainer.fabric.global_rank}.pt",
)
