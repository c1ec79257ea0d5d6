"""A Trainer without its loop, for the monitoring callbacks' tests (imported by name: pytest puts this folder on
``sys.path``): a State, a Logger recording into an InMemoryLogger, and an Engine firing events by hand."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric.trainer.core.callback import Callback
from fabric.trainer.core.engine import Engine
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time
from fabric.trainer.loggers import InMemoryLogger, Logger
from fabric.trainer.loggers.destination import LoggerDestination


class Rig:
    def __init__(
        self,
        *callbacks: Callback,
        model: nn.Module | None = None,
        fabric: Any = None,
        destinations: tuple[LoggerDestination, ...] = (),
    ) -> None:
        self.state = State(model=model or nn.Linear(2, 1), max_duration=Time.from_timestring("100ba"))
        self.state.fabric = fabric
        self.state.run_name = "the-run"
        self.memory = InMemoryLogger()
        self.logger = Logger(self.state, [self.memory, *destinations])
        self.engine = Engine(self.state, self.logger, callbacks=callbacks)

    def run(self, *events: Event) -> None:
        for event in events:
            self.engine.run_event(event)

    def advance(self, samples: int = 4) -> None:
        """The clock moves past one batch, as the Trainer's after the optimizer step."""
        self.state.timestamp = self.state.timestamp.to_next_batch(samples, 0, timedelta(seconds=1))

    def batch(self) -> None:
        """BATCH_START, the clock advancing, BATCH_END: a batch for callbacks that only watch its ends."""
        self.run(Event.BATCH_START)
        self.advance()
        self.run(Event.BATCH_END)

    def values(self, name: str) -> list[float]:
        return [value for _, value in self.memory.data.get(name, [])]

    def steps(self, name: str) -> list[int]:
        return [step for step, _ in self.memory.data.get(name, [])]


def fake_cuda_fabric(rank: int = 0, world_size: int = 1, **more: Any) -> SimpleNamespace:
    """What the callbacks read of a Fabric training on CUDA, without a GPU."""
    return SimpleNamespace(device=torch.device("cuda", 0), global_rank=rank, world_size=world_size, **more)


class Regressor(nn.Module):
    """A Trainer model: ``forward(batch)`` on ``(x, y)`` batches, ``loss(outputs, batch)``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        outputs: torch.Tensor = self.net(batch[0])
        return outputs

    def loss(self, outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(outputs, batch[1])


def fit(model: nn.Module, callbacks: list[Callback], optimizer: Any = None, **options: Any) -> InMemoryLogger:
    """A real Trainer fit on CPU over 2 epochs of 3 batches of 8 samples; what it logged."""
    from fabric.trainer.trainer import Trainer

    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, 3, generator=generator), torch.randn(24, 1, generator=generator))
    memory = InMemoryLogger()
    trainer = Trainer(
        model,
        DataLoader(data, batch_size=8),
        max_duration=options.pop("max_duration", "2ep"),
        optimizers=optimizer or torch.optim.SGD(model.parameters(), lr=0.05),
        callbacks=callbacks,
        loggers=[memory],
        progress_bar=False,
        accelerator="cpu",
        devices=1,
        seed=0,
        **options,
    )
    trainer.fit()
    trainer.close()
    return memory
