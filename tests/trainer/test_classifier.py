"""TrainerClassifier: a plain nn.Module classifier trains in the Trainer as seed 003's optimizer example writes it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import SGD
from torch.optim.lr_scheduler import LinearLR
from torch.utils.data import DataLoader, TensorDataset

from fabric.trainer import Trainer
from fabric.trainer.algorithms.mixup import MixUp
from fabric.trainer.classifier import TrainerClassifier
from fabric.trainer.loggers import InMemoryLogger


def _data(samples: int = 96, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 8, generator=generator)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())  # 3 classes


def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _fit(model: TrainerClassifier, **kwargs: Any) -> tuple[Trainer, InMemoryLogger]:
    optimizer = SGD(model.parameters(), lr=0.1)
    memory = InMemoryLogger()
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(_data(), batch_size=16, shuffle=True),
        eval_dataloader=DataLoader(_data(48, seed=1), batch_size=16),
        max_duration="4ep",
        optimizers=optimizer,
        schedulers=LinearLR(optimizer),
        step_schedulers_every_batch=True,  # a warm-up over 5 batches, not 5 of the 4 epochs
        loggers=memory,
        progress_bar=False,
        accelerator="cpu",
        seed=0,
        **kwargs,
    )
    trainer.fit()
    return trainer, memory


def test_a_plain_module_trains_with_the_default_loss_and_composers_metric_names() -> None:
    model = TrainerClassifier(_module(), num_classes=3)
    trainer, memory = _fit(model)
    inputs, targets = _data(48, seed=1).tensors
    with torch.no_grad():
        logits = model.module(inputs)
    accuracy = (logits.argmax(1) == targets).float().mean().item()
    assert memory.most_recent_values["metrics/eval/MulticlassAccuracy"] == pytest.approx(accuracy)
    assert memory.most_recent_values["metrics/eval/CrossEntropy"] == pytest.approx(F.cross_entropy(logits, targets))
    assert 0.0 <= trainer.state.metrics["metrics/train/MulticlassAccuracy"] <= 1.0  # the last batch's
    # Composer's State keeps the last values by metric name too (llm-foundry's fdiff_metrics reads them)
    assert trainer.state.train_metric_values == {
        "MulticlassAccuracy": trainer.state.metrics["metrics/train/MulticlassAccuracy"]
    }
    assert trainer.state.eval_metric_values == {
        "MulticlassAccuracy": pytest.approx(accuracy),
        "CrossEntropy": pytest.approx(F.cross_entropy(logits, targets)),
    }
    losses = [value for _, value in memory.data["loss/train/total"]]
    assert losses[-1] < losses[0] and accuracy > 0.6  # it learned the three regions
    assert model.num_classes == 3 and "module.0.weight" in model.state_dict()  # metrics are not part of the state


def test_soft_targets_from_mixup_train_through_the_default_loss() -> None:
    model = TrainerClassifier(_module())
    _, memory = _fit(model, algorithms=MixUp(alpha=0.2))
    losses = [value for _, value in memory.data["loss/train/total"]]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_torchmetrics_metrics_are_named_by_their_class() -> None:
    torchmetrics = pytest.importorskip("torchmetrics")
    accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
    model = TrainerClassifier(_module(), val_metrics=[accuracy])
    trainer, _ = _fit(model)
    inputs, targets = _data(48, seed=1).tensors
    with torch.no_grad():
        expected = (model.module(inputs).argmax(1) == targets).float().mean().item()
    assert trainer.eval() == {"metrics/eval/MulticlassAccuracy": pytest.approx(expected)}


def test_bad_arguments_are_refused_naming_them() -> None:
    with pytest.raises(TypeError, match=r"needs an nn\.Module, got str"):
        TrainerClassifier("resnet50")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"num_classes=2\.5 is not valid"):
        TrainerClassifier(_module(), num_classes=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="two metrics named 'accuracy'"):
        TrainerClassifier(_module(), train_metrics=[_accuracy, _accuracy])
    with pytest.raises(TypeError, match="takes \\(inputs, targets\\) batches, got a Tensor"):
        TrainerClassifier(_module())(torch.ones(2, 8))


def _accuracy(outputs: torch.Tensor, batch: Any) -> torch.Tensor:
    return (outputs.argmax(1) == batch[1]).float().mean()


_accuracy.__name__ = "accuracy"
