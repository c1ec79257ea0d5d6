"""The Trainer: a ready loop with two algorithms, a warmup schedule, callbacks and a logger.

    python examples/trainer_train.py                                       # one process
    python examples/trainer_train.py --devices 2 --strategy ddp --accelerator cpu   # starts rank 1 itself
    fabric run model --accelerator=cpu --devices=2 --strategy=ddp examples/trainer_train.py

Without --accelerator/--devices/--strategy the script leaves the choice to Fabric, so under
``fabric run model`` the CLI's settings apply. Rank 0 prints one line per evaluation (ConsoleLogger)
and a summary; the model learns a noisy 4-class problem, with label smoothing and gradient clipping
on and a cosine learning-rate schedule after a linear warmup.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric.trainer.algorithms.gradient_clipping import GradientClipping
from fabric.trainer.algorithms.label_smoothing import LabelSmoothing
from fabric.trainer.callbacks import LRMonitor, SpeedMonitor
from fabric.trainer.loggers.console import ConsoleLogger
from fabric.trainer.loggers.in_memory import InMemoryLogger
from fabric.trainer.model import TrainerModel
from fabric.trainer.schedulers import CosineAnnealingWithWarmupScheduler
from fabric.trainer.trainer import Trainer

Batch = tuple[torch.Tensor, torch.Tensor]


class Classifier(TrainerModel):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.net(batch[0])  # type: ignore[no-any-return]

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        # LabelSmoothing hands in soft targets (probabilities); cross_entropy takes both forms.
        return F.cross_entropy(outputs, batch[1])

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        return {"accuracy": lambda outputs, batch: (outputs.argmax(-1) == batch[1]).float().mean()}


def make_data(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)) * 0.45
    labels = torch.randint(0, 4, (samples,), generator=generator)
    inputs = centers[labels] + torch.randn(samples, 16, generator=generator)
    return TensorDataset(inputs, labels)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--accelerator")
    parser.add_argument("--devices", type=int)
    parser.add_argument("--strategy")
    parser.add_argument("--precision")
    args = parser.parse_args()
    fabric_choices = {
        name: value
        for name, value in vars(args).items()
        if name in ("accelerator", "devices", "strategy", "precision") and value is not None
    }

    torch.manual_seed(17)  # the model's initial weights; Trainer(seed=...) seeds the rest
    model = Classifier()
    history = InMemoryLogger()
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(make_data(4096, seed=1), batch_size=64, shuffle=True),
        eval_dataloader=DataLoader(make_data(1024, seed=2), batch_size=256),
        max_duration=f"{args.epochs}ep",
        optimizers=torch.optim.AdamW(model.parameters(), lr=3e-3),
        schedulers=CosineAnnealingWithWarmupScheduler(t_warmup="20ba", alpha_f=0.1),
        algorithms=[LabelSmoothing(smoothing=0.1), GradientClipping(clipping_type="norm", clipping_threshold=1.0)],
        callbacks=[SpeedMonitor(window_size=20), LRMonitor()],
        loggers=[ConsoleLogger(log_interval="1ep"), history],
        progress_bar=False,
        seed=17,
        **fabric_choices,
    )
    trainer.fit()
    state = trainer.state
    accuracy = state.metrics["metrics/eval/accuracy"]
    samples_per_sec = history.most_recent_values.get("throughput/samples_per_sec", float("nan"))
    trainer.fabric.print(
        f"done: {trainer.fabric.world_size} rank(s), {int(state.timestamp.batch)} batches, "
        f"{int(state.timestamp.sample)} samples, eval accuracy {accuracy:.3f}, {samples_per_sec:,.0f} samples/s"
    )
    trainer.close()


if __name__ == "__main__":
    main()
