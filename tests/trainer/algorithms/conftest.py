"""Shared fixtures for the algorithm tests: tiny synthetic tasks, and Trainer runs giving the loss before and after."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fabric.trainer.core.algorithm import Algorithm


class TinyImageClassifier(nn.Module):
    """Conv -> BatchNorm -> ReLU -> global pooling -> Linear over ``(inputs, targets)`` batches; any image size."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, classes)

    def forward(self, batch: Any) -> torch.Tensor:
        features = torch.relu(self.norm(self.conv(batch[0])))
        return self.head(features.mean(dim=(2, 3)))

    def loss(self, outputs: torch.Tensor, batch: Any, reduction: str = "mean") -> torch.Tensor:
        return F.cross_entropy(outputs, batch[1], reduction=reduction)


def image_classes(samples: int = 192, size: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Images whose class (0, 1, 2) sets their mean brightness (-1, 0, +1), plus noise: learnable from any crop."""
    generator = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, 3, (samples,), generator=generator)
    images = (targets.float() - 1.0).view(-1, 1, 1, 1) + 0.5 * torch.randn(samples, 1, size, size, generator=generator)
    return images, targets


@torch.no_grad()
def dataset_loss(model: nn.Module, images: torch.Tensor, targets: torch.Tensor) -> float:
    was_training = model.training
    model.eval()
    loss = F.cross_entropy(model((images, targets)), targets).item()
    model.train(was_training)
    return loss


@pytest.fixture
def learn_images() -> Callable[..., tuple[float, float]]:
    """Train TinyImageClassifier with the Trainer and ``algorithms``; returns (loss before, loss after)."""

    def run(
        algorithms: Sequence[Algorithm], max_duration: str = "6ep", lr: float = 0.05, **trainer_args: Any
    ) -> tuple[float, float]:
        from fabric.trainer.trainer import Trainer

        torch.manual_seed(0)
        images, targets = image_classes()
        model = TinyImageClassifier()
        before = dataset_loss(model, images, targets)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, targets), batch_size=32)
        trainer = Trainer(
            model=model,
            train_dataloader=loader,
            max_duration=max_duration,
            optimizers=torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
            algorithms=list(algorithms),
            progress_bar=False,
            seed=0,
            accelerator="cpu",
            **trainer_args,
        )
        trainer.fit()
        trainer.close()
        return before, dataset_loss(model, images, targets)

    return run


_BENCHMARK = Path(__file__).resolve().parents[3] / "benchmarks" / "algorithms.py"


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run torch on one thread: on the shared 2-core test machine two threads make small convs many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def image_task() -> ModuleType:
    """``benchmarks/algorithms.py``: its ``SmallResNet``, ``ResidualBlock``, ``synthetic_patterns`` and ``train``."""
    spec = importlib.util.spec_from_file_location("benchmark_algorithms", _BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def accuracy_after_training(image_task: ModuleType, one_thread: None) -> Callable[[Sequence[Algorithm]], float]:
    """Trains a width-8 SmallResNet (residual blocks, BatchNorm, strided convs) on 1024 synthetic 3x16x16 images
    for 3 epochs through the Trainer with ``algorithms``; returns its held-out accuracy (10 classes: chance is 0.1)."""
    train_set, test_set = image_task.synthetic_patterns(1024, seed=0), image_task.synthetic_patterns(512, seed=1)

    def accuracy(algorithms: Sequence[Algorithm]) -> float:
        curve = image_task.train(algorithms, train_set, test_set, epochs=3, width=8)
        return float(curve.points[-1][2])

    return accuracy
