"""Composer's metric classes (``composer.metrics``) under ``fabric.trainer.metrics``: each against the quantity it
names, computed directly; and a language model trained and evaluated with them by the Trainer, read back after."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fabric.trainer.metrics as metrics
from fabric.trainer import ComposerModel, Evaluator, Trainer

pytest.importorskip("torchmetrics")  # the [test] extra installs it; the metrics say how when it is missing

IGNORE = -100


def _tokens(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 7, generator=generator)
    targets = torch.randint(0, 7, (3, 5), generator=generator)
    targets[0, :2] = IGNORE
    return logits, targets


def test_every_composer_metric_name_imports_and_map_is_refused_naming_the_alternative() -> None:
    for name in metrics.COMPOSER_METRICS:
        assert isinstance(getattr(metrics, name), type), name
    with pytest.raises(ImportError, match=r"MAP is not provided.*MeanAveragePrecision"):
        from fabric.trainer.metrics import MAP  # noqa: F401


def test_language_cross_entropy_and_perplexity_count_only_target_tokens_over_batches() -> None:
    entropy, perplexity = metrics.LanguageCrossEntropy(), metrics.LanguagePerplexity()
    batches = [_tokens(0), _tokens(1)]
    for logits, targets in batches:
        entropy.update({"logits": logits}, targets)  # a Hugging Face output
        perplexity.update(logits, targets)
    logits = torch.cat([b[0] for b in batches]).reshape(-1, 7)
    targets = torch.cat([b[1] for b in batches]).reshape(-1)
    expected = F.cross_entropy(logits, targets, ignore_index=IGNORE).item()
    assert entropy.compute().item() == pytest.approx(expected)
    assert perplexity.compute().item() == pytest.approx(math.exp(expected))


def test_masked_accuracy_leaves_ignored_tokens_out() -> None:
    logits, targets = _tokens()
    accuracy = metrics.MaskedAccuracy(ignore_index=IGNORE)
    accuracy.update(logits, targets)
    counted = targets != IGNORE
    expected = (logits.argmax(-1) == targets)[counted].float().mean().item()
    assert accuracy.compute().item() == pytest.approx(expected)


def test_cross_entropy_takes_class_indices_and_class_probabilities() -> None:
    logits, targets = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, IGNORE, 1])
    indices = metrics.CrossEntropy()
    indices.update(logits, targets)
    assert indices.compute().item() == pytest.approx(F.cross_entropy(logits, targets, ignore_index=IGNORE).item())
    probabilities = torch.softmax(torch.randn(6, 4), dim=1)
    soft = metrics.CrossEntropy()
    soft.update(logits, probabilities)
    assert soft.compute().item() == pytest.approx(F.cross_entropy(logits, probabilities).item())


def test_loss_metric_averages_the_loss_per_batch_and_refuses_unreduced_losses() -> None:
    metric = metrics.LossMetric(F.mse_loss)
    pairs = [(torch.zeros(2), torch.ones(2)), (torch.zeros(4), torch.full((4,), 3.0))]
    for preds, target in pairs:
        metric.update(preds, target)
    assert metric.compute().item() == pytest.approx((1.0 + 9.0) / 2)
    with pytest.raises(ValueError, match="gave 2 values"):
        metrics.LossMetric(lambda p, t: (p - t) ** 2).update(torch.zeros(2), torch.ones(2))


def test_segmentation_scores_from_per_class_counts() -> None:
    # predictions per pixel: class of the highest logit
    predictions = torch.tensor([[0, 0, 1, 1], [2, 2, 2, 0]])
    targets = torch.tensor([[0, 1, 1, 1], [2, 2, -1, 1]])
    logits = F.one_hot(predictions, 3).permute(0, 2, 1).float()  # (N, C, pixels)
    iou, dice = metrics.MIoU(num_classes=3), metrics.Dice(num_classes=3)
    for metric in (iou, dice):
        metric.update(logits, targets)
    # class 0: TP 1, FP 2, FN 0; class 1: TP 2, FP 0, FN 2; class 2: TP 2, FP 0, FN 0 (the -1 pixel is left out)
    assert iou.compute().item() == pytest.approx((1 / 3 + 2 / 4 + 2 / 2) / 3)
    assert dice.compute().item() == pytest.approx((2 / 4 + 4 / 6 + 4 / 4) / 3)
    with pytest.raises(ValueError, match=r"num_classes=0 is not valid"):
        metrics.MIoU(num_classes=0)


def test_binary_f1_score() -> None:
    logits = torch.tensor([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    targets = torch.tensor([1, 0, 1, 0, 1])
    f1 = metrics.BinaryF1Score()
    f1.update(logits, targets)
    assert f1.compute().item() == pytest.approx(2 / (2 + 0.5 * (1 + 1)))  # TP 2, FP 1, FN 1


class TinyLanguageModel(ComposerModel):
    """Next-token prediction over a vocabulary of 11, with Composer's language metrics."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(11, 16)
        self.head = nn.Linear(16, 11)
        self.train_metrics = {"LanguageCrossEntropy": metrics.LanguageCrossEntropy()}
        self.eval_metrics = {
            "LanguageCrossEntropy": metrics.LanguageCrossEntropy(),
            "LanguagePerplexity": metrics.LanguagePerplexity(),
            "MaskedAccuracy": metrics.MaskedAccuracy(),
        }

    def forward(self, batch: Any) -> torch.Tensor:
        return self.head(self.embedding(batch[0]))  # type: ignore[no-any-return]

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.cross_entropy(outputs.reshape(-1, 11), batch[1].reshape(-1), ignore_index=IGNORE)

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        return self.train_metrics if is_train else self.eval_metrics


def test_a_language_model_trains_and_its_metrics_read_back_after_fit() -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, 11, (32, 9))
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[:, :2] = IGNORE  # a prompt the loss leaves out
    loader = DataLoader(TensorDataset(inputs, labels), batch_size=8)
    model = TinyLanguageModel()
    trainer = Trainer(model=model, train_dataloader=loader, eval_dataloader=loader, max_duration="2ep",
                      optimizers=torch.optim.Adam(model.parameters(), lr=0.05), progress_bar=False)  # fmt: skip
    trainer.fit()
    with torch.no_grad():
        logits = model((inputs, labels))
    expected = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=IGNORE).item()
    read_back = {name: float(metric.compute()) for name, metric in trainer.state.eval_metrics["eval"].items()}
    assert read_back["LanguageCrossEntropy"] == pytest.approx(expected, rel=1e-5)
    assert read_back["LanguagePerplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
    counted = labels != IGNORE
    accuracy = (logits.argmax(-1) == labels)[counted].float().mean().item()
    assert read_back["MaskedAccuracy"] == pytest.approx(accuracy)
    assert expected < math.log(11)  # it learned something: below the uniform guess


def test_in_memory_logger_gives_a_metric_over_time_to_plot() -> None:
    """The getting-started tutorial plots ``get_timeseries("metrics/eval/...")`` against batches."""
    from fabric.trainer.loggers import InMemoryLogger

    torch.manual_seed(0)
    tokens = torch.randint(0, 11, (16, 5))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)  # 4 batches an epoch
    memory = InMemoryLogger()
    model = TinyLanguageModel()
    trainer = Trainer(model=model, train_dataloader=loader, eval_dataloader=loader, max_duration="3ep",
                      eval_interval="2ba", loggers=memory, progress_bar=False)  # fmt: skip
    trainer.fit()
    series = memory.get_timeseries("metrics/eval/LanguagePerplexity")
    assert series["batch"] == [2, 4, 6, 8, 10, 12]
    assert series["epoch"] == [0, 0, 1, 1, 2, 2]  # at batch 4 the first epoch has not ended yet (EPOCH_END is next)
    assert series["sample"] == [8, 16, 24, 32, 40, 48]
    assert len(series["metrics/eval/LanguagePerplexity"]) == 6
    assert series["metrics/eval/LanguagePerplexity"][-1] == pytest.approx(trainer.state.metrics[
        "metrics/eval/LanguagePerplexity"])  # fmt: skip
    losses = memory.get_timeseries("loss/train/total")
    assert losses["batch"] == list(range(1, 13)) and losses["batch_in_epoch"] == [1, 2, 3, 4] * 3
    with pytest.raises(ValueError, match=r"No values of 'accuracy' were logged; logged: \[.*'loss/train/total'"):
        memory.get_timeseries("accuracy")


def test_the_trainers_metric_functions_keep_their_import_path_after_the_move_into_a_package() -> None:
    """``fabric/trainer/metrics.py`` became the package ``fabric/trainer/metrics/``; its names import as before."""
    from fabric.trainer.metrics import CallableMetric, compute_metrics, model_metrics, rounds, update_metric

    assert (CallableMetric, compute_metrics, model_metrics, update_metric) == (
        rounds.CallableMetric, rounds.compute_metrics, rounds.model_metrics, rounds.update_metric
    )  # fmt: skip


class SharedMetricsClassifier(ComposerModel):
    """Composer-style: one metric dict returned for training and evaluation alike (Composer copies it per use)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 3)
        self.metrics = {"accuracy": metrics.MaskedAccuracy(ignore_index=IGNORE)}

    def forward(self, batch: Any) -> torch.Tensor:
        return self.net(batch[0])

    def loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        return F.cross_entropy(outputs, batch[1])

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        return self.metrics

    def update_metric(self, batch: Any, outputs: Any, metric: Any) -> None:
        metric.update(outputs, batch[1])


def test_each_evaluator_and_training_keep_their_own_metric_state_when_the_model_shares_one_dict() -> None:
    """Every evaluator and training used the model's very objects: after fit(), state.eval_metrics["a"] read back the
    last evaluator's state (or the last training batch's), not its own."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(48, 4, generator=generator)
    y = torch.randint(0, 3, (48,), generator=generator)
    a, b = TensorDataset(x[:16], y[:16]), TensorDataset(x[16:32], torch.zeros(16, dtype=torch.long))
    torch.manual_seed(0)  # the model's initial weights: not whatever the tests before left in the global generator
    model = SharedMetricsClassifier()
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(TensorDataset(x[32:], y[32:]), batch_size=8),
        eval_dataloader=[Evaluator("a", DataLoader(a, batch_size=8)), Evaluator("b", DataLoader(b, batch_size=8))],
        max_duration="1ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        progress_bar=False,
        accelerator="cpu",
    )
    trainer.fit()
    with torch.no_grad():
        expected = {
            label: (model.net(data.tensors[0]).argmax(-1) == data.tensors[1]).float().mean().item()
            for label, data in (("a", a), ("b", b))
        }
    read_back = {label: trainer.state.eval_metrics[label]["accuracy"].compute().item() for label in ("a", "b")}
    assert read_back == pytest.approx(expected)
    assert expected["a"] != pytest.approx(expected["b"])  # the two sets tell the states apart
    assert trainer.state.metrics["metrics/a/accuracy"] == pytest.approx(expected["a"])
    assert trainer.state.train_metrics["accuracy"] is not trainer.state.eval_metrics["a"]["accuracy"]
