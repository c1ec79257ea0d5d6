"""MixUp, CutMix and LabelSmoothing: the stated convex combinations, restored targets, and the closed-form loss."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fabric.trainer.algorithms.cutmix import CutMix, cutmix_batch
from fabric.trainer.algorithms.label_smoothing import LabelSmoothing, smooth_labels
from fabric.trainer.algorithms.mixup import MixUp, mixup_batch
from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.engine import Engine
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time

CLASSES = 4


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, CLASSES)

    def forward(self, batch: Any) -> torch.Tensor:
        return self.layer(batch[0])

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.cross_entropy(outputs, batch[1])


def _engine(algorithms: list[Algorithm], batch: Any) -> Engine:
    state = State(model=Linear(), max_duration=Time.from_timestring("10ba"))
    state.batch = batch
    return Engine(state, logger=None, algorithms=algorithms)


def test_mixup_batch_is_the_convex_combination_with_the_sampled_lambda() -> None:
    inputs, targets = torch.randn(8, 6), torch.arange(8)  # targets name each sample, so they reveal the permutation
    mixed, permuted, mixing = mixup_batch(inputs, targets, alpha=1.0, generator=torch.Generator().manual_seed(3))
    assert 0 < mixing < 1
    assert sorted(permuted.tolist()) == list(range(8))
    torch.testing.assert_close(mixed, (1 - mixing) * inputs + mixing * inputs[permuted])
    again = mixup_batch(inputs, targets, alpha=1.0, generator=torch.Generator().manual_seed(3))
    assert again[2] == mixing and torch.equal(again[0], mixed)


def test_mixup_algorithm_mixes_inputs_and_soft_targets_then_restores_them() -> None:
    inputs, targets = torch.randn(8, 6), torch.randint(0, CLASSES, (8,))
    mixup = MixUp(alpha=1.0)
    engine = _engine([mixup], (inputs, targets))
    engine.run_event(Event.BEFORE_FORWARD)
    permutation, mixing = mixup._permutation, mixup.mixing
    assert permutation is not None
    torch.testing.assert_close(engine.state.batch[0], (1 - mixing) * inputs + mixing * inputs[permutation])
    engine.state.outputs = engine.state.model(engine.state.batch)
    engine.run_event(Event.BEFORE_LOSS)
    one_hot = F.one_hot(targets, CLASSES).float()
    torch.testing.assert_close(engine.state.batch[1], (1 - mixing) * one_hot + mixing * one_hot[permutation])
    engine.state.loss = torch.tensor(0.0)
    engine.run_event(Event.AFTER_LOSS)
    assert engine.state.batch[0] is inputs and engine.state.batch[1] is targets


def test_mixup_interpolate_loss_mixes_the_two_losses_on_a_mapping_batch() -> None:
    class DictLinear(Linear):
        def forward(self, batch: Any) -> torch.Tensor:
            return self.layer(batch["x"])

        def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
            return F.cross_entropy(outputs, batch["y"])

    inputs, targets = torch.randn(8, 6), torch.randint(0, CLASSES, (8,))
    mixup = MixUp(alpha=1.0, interpolate_loss=True, input_key="x", target_key="y")
    state = State(model=DictLinear(), max_duration=Time.from_timestring("10ba"))
    state.batch = {"x": inputs, "y": targets}
    engine = Engine(state, logger=None, algorithms=[mixup])
    engine.run_event(Event.BEFORE_FORWARD)
    permutation, mixing = mixup._permutation, mixup.mixing
    assert permutation is not None
    state.outputs = state.model(state.batch)
    engine.run_event(Event.BEFORE_LOSS)
    assert state.batch["y"] is targets  # interpolate_loss leaves the targets as class indices
    state.loss = state.model.loss(state.outputs, state.batch)  # type: ignore[operator]
    engine.run_event(Event.AFTER_LOSS)
    expected = (1 - mixing) * F.cross_entropy(state.outputs, targets) + mixing * F.cross_entropy(
        state.outputs, targets[permutation]
    )
    torch.testing.assert_close(state.loss, expected)
    assert state.batch["x"] is inputs and state.batch["y"] is targets


def test_cutmix_box_area_is_the_mixing_share_and_only_the_box_comes_from_the_partner() -> None:
    inputs = torch.arange(6.0).view(6, 1, 1, 1).expand(6, 2, 10, 12).clone()  # sample i is filled with i
    targets = torch.arange(6)
    mixed, permuted, mixing = cutmix_batch(inputs, targets, alpha=1.0, generator=torch.Generator().manual_seed(1))
    for sample in range(6):
        from_partner = (mixed[sample] == float(permuted[sample])) & (permuted[sample] != sample)
        if permuted[sample] != sample:
            assert from_partner.float().mean().item() == pytest.approx(mixing)
            rows, cols = from_partner[0].nonzero(as_tuple=True)
            box_area = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
            assert int(box_area) == from_partner[0].sum()  # one rectangle, same in every channel
        assert torch.equal(mixed[sample][~from_partner], inputs[sample][~from_partner])


def test_cutmix_algorithm_targets_use_the_exact_box_share() -> None:
    inputs, targets = torch.randn(6, 1, 8, 8), torch.randint(0, CLASSES, (6,))
    cutmix = CutMix(alpha=1.0)
    engine = _engine([cutmix], (inputs, targets))
    engine.run_event(Event.BEFORE_FORWARD)
    changed = (engine.state.batch[0] != inputs).flatten(1).any(dim=0).view(8, 8)
    permutation, mixing = cutmix._permutation, cutmix.mixing
    assert permutation is not None
    assert changed.float().mean().item() <= mixing + 1e-9  # the box holds every changed pixel
    engine.state.outputs = torch.zeros(6, CLASSES)
    engine.run_event(Event.BEFORE_LOSS)
    one_hot = F.one_hot(targets, CLASSES).float()
    torch.testing.assert_close(engine.state.batch[1], (1 - mixing) * one_hot + mixing * one_hot[permutation])


def test_smooth_labels_closed_form() -> None:
    logits, targets = torch.randn(5, CLASSES), torch.tensor([0, 1, 2, 3, 0])
    expected = 0.8 * F.one_hot(targets, CLASSES).float() + 0.2 / CLASSES
    torch.testing.assert_close(smooth_labels(logits, targets, 0.2), expected)


@pytest.mark.parametrize("order", ["mixup_first", "smoothing_first"])
def test_label_smoothing_with_mixup_restores_targets_and_gives_the_closed_form_loss(order: str) -> None:
    torch.manual_seed(0)
    inputs, targets = torch.randn(8, 6), torch.randint(0, CLASSES, (8,))
    mixup, smoothing = MixUp(alpha=1.0), LabelSmoothing(smoothing=0.1)
    engine = _engine([mixup, smoothing] if order == "mixup_first" else [smoothing, mixup], (inputs, targets))
    engine.run_event(Event.BEFORE_FORWARD)
    permutation, mixing = mixup._permutation, mixup.mixing
    assert permutation is not None
    engine.state.outputs = engine.state.model(engine.state.batch)
    engine.run_event(Event.AFTER_FORWARD)
    engine.run_event(Event.BEFORE_LOSS)
    engine.state.loss = engine.state.model.loss(engine.state.outputs, engine.state.batch)  # type: ignore[operator]
    engine.run_event(Event.AFTER_LOSS)

    assert engine.state.batch[1] is targets and engine.state.batch[0] is inputs
    one_hot = F.one_hot(targets, CLASSES).float()
    soft = 0.9 * ((1 - mixing) * one_hot + mixing * one_hot[permutation]) + 0.1 / CLASSES
    expected = -(soft * engine.state.outputs.log_softmax(dim=1)).sum(dim=1).mean()
    torch.testing.assert_close(engine.state.loss, expected)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: MixUp(alpha=0), "alpha=0"),
        (lambda: CutMix(alpha=-1.0), "alpha=-1.0"),
        (lambda: MixUp(alpha=float("nan")), "alpha=nan"),
        (lambda: LabelSmoothing(smoothing=1.0), r"smoothing=1.0 must be in \[0, 1\)"),
        (lambda: LabelSmoothing(smoothing=-0.1), "smoothing=-0.1"),
        (lambda: MixUp(input_key=1.5), "input_key=1.5"),  # type: ignore[arg-type]
    ],
)
def test_bad_arguments_fail_at_construction(build: Any, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        build()
