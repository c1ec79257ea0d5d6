"""GradientClipping bounds the total norm or each value, and AGC follows its unit-wise formula."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fabric.trainer.algorithms.gradient_clipping import GradientClipping, apply_gradient_clipping
from fabric.trainer.core.engine import Engine
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time


def _model_with_gradients(scale: float = 10.0) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Conv1d(4, 3, 1))
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter) * scale
    return model


def _clip_through_engine(model: nn.Module, clipping_type: str, threshold: float) -> None:
    state = State(model=model, max_duration=Time.from_timestring("1ba"))
    Engine(state, None, [GradientClipping(clipping_type, threshold)]).run_event(Event.AFTER_TRAIN_BATCH)


def test_norm_clipping_scales_the_total_norm_to_the_threshold() -> None:
    model = _model_with_gradients()
    before = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    _clip_through_engine(model, "norm", 1.5)
    grads = [p.grad for p in model.parameters()]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))  # type: ignore[arg-type]
    assert total.item() == pytest.approx(1.5, rel=1e-4)
    ratio = grads[0] / before[0]  # type: ignore[operator]
    torch.testing.assert_close(ratio, torch.full_like(ratio, ratio.flatten()[0].item()))  # direction kept


def test_norm_clipping_leaves_small_gradients_alone() -> None:
    model = _model_with_gradients(scale=1e-3)
    before = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    _clip_through_engine(model, "norm", 1.5)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))  # type: ignore[arg-type]


def test_value_clipping_clamps_each_entry() -> None:
    model = _model_with_gradients(scale=1.0)
    before = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    _clip_through_engine(model, "value", 0.5)
    for parameter, grad in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(parameter.grad, grad.clamp(-0.5, 0.5))


def test_adaptive_clipping_follows_the_unitwise_formula() -> None:
    model = _model_with_gradients(scale=1.0)
    expected = []
    for parameter in model.parameters():
        grad = parameter.grad.clone()  # type: ignore[union-attr]
        units = parameter.detach().reshape(parameter.shape[0], -1) if parameter.ndim > 1 else parameter.detach()[None]
        grad_units = grad.reshape(units.shape)
        for unit in range(units.shape[0]):
            max_norm = 0.05 * max(units[unit].norm().item(), 1e-3)
            norm = grad_units[unit].norm().item()
            if norm > max_norm:
                grad_units[unit] *= max_norm / norm
        expected.append(grad_units.reshape(parameter.shape))
    apply_gradient_clipping(model, "adaptive", 0.05)
    for parameter, grad in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(parameter.grad, grad)
    weight = model[0].weight
    ratio = weight.grad.norm(dim=1) / weight.detach().norm(dim=1)  # type: ignore[union-attr]
    assert (ratio <= 0.05 + 1e-6).all()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("l2", 1.0), "clipping_type='l2' is not supported; use one of norm, value, adaptive"),
        (("norm", 0.0), "clipping_threshold=0.0 must be"),
        (("value", float("inf")), "clipping_threshold=inf must be"),
    ],
)
def test_bad_arguments_fail_at_construction(args: tuple[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GradientClipping(*args)
