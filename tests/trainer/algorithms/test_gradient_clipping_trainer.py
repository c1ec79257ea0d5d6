"""GradientClipping through the Trainer with fp16 autocast and a GradScaler: it clips the true (unscaled) gradients
after the Trainer's single unscale, steps whose scaled gradients overflowed are still skipped by the scaler, and
the optimizer steps with the clipped gradients."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric.strategies.deepspeed import DeepSpeedStrategy
from fabric.trainer.algorithms.gradient_clipping import GradientClipping, apply_gradient_clipping
from fabric.trainer.core.callback import Callback
from fabric.trainer.core.engine import Engine
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time
from fabric.trainer.trainer import Trainer

LR = 0.1
BATCH = 8
BATCHES_PER_EPOCH = 4
STEPS = 12  # the default initial loss scale (65536) overflows the first steps; the scaler backs off, then steps
CASES = [("norm", 0.5), ("value", 0.05), ("adaptive", 0.01)]
Batch = tuple[torch.Tensor, torch.Tensor]


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.net(batch[0])  # type: ignore[no-any-return]

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        return F.mse_loss(outputs, batch[1])


class RecordSteps(Callback):
    """At AFTER_TRAIN_BATCH (after the algorithms, before the step): the weights, gradients and loss scale; at
    BATCH_END: the weights the optimizer produced, and whether the scaler backed off (the step overflowed)."""

    def __init__(self) -> None:
        self.before: list[list[torch.Tensor]] = []
        self.grads: list[list[torch.Tensor]] = []
        self.after: list[list[torch.Tensor]] = []
        self.overflowed: list[bool] = []
        self.scale = 0.0

    def after_train_batch(self, state: State, logger: Any) -> None:
        parameters = list(state.model.parameters())
        self.before.append([p.detach().clone() for p in parameters])
        self.grads.append([p.grad.detach().clone() for p in parameters])  # type: ignore[union-attr]
        self.scale = _scaler(state).get_scale()

    def batch_end(self, state: State, logger: Any) -> None:
        self.after.append([p.detach().clone() for p in state.model.parameters()])
        self.overflowed.append(_scaler(state).get_scale() < self.scale)


def _scaler(state: State) -> torch.amp.GradScaler:
    scaler = state.fabric.strategy.precision.scaler
    assert isinstance(scaler, torch.amp.GradScaler)
    return scaler


def _data() -> TensorDataset:
    x = torch.randn(BATCH * BATCHES_PER_EPOCH, 6, generator=torch.Generator().manual_seed(1))
    return TensorDataset(x, 5.0 * x.sum(dim=1, keepdim=True))  # large targets: gradients far above the thresholds


@functools.cache
def _train(clipping_type: str, threshold: float) -> tuple[nn.Module, RecordSteps]:
    """The initial model, and what every step of training a copy of it under ``precision="16-mixed"`` recorded."""
    torch.manual_seed(0)
    initial = Regressor()
    model, recorder = copy.deepcopy(initial), RecordSteps()
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(_data(), batch_size=BATCH),
        max_duration=f"{STEPS}ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=LR),
        algorithms=[GradientClipping(clipping_type, threshold)],
        callbacks=[recorder],
        precision="16-mixed",
        progress_bar=False,
        seed=0,
        accelerator="cpu",
    )
    trainer.fit()  # no "unscale_() has already been called" error
    assert len(recorder.grads) == STEPS
    assert recorder.scale >= 2.0  # the loss really was scaled
    return initial, recorder


def _reference_gradients(model: nn.Module, weights: list[torch.Tensor], batch: Batch) -> list[torch.Tensor]:
    """The true gradients at ``weights``: fp16 autocast forward, backward of the loss without any scaling."""
    with torch.no_grad():
        for parameter, weight in zip(model.parameters(), weights, strict=True):
            parameter.copy_(weight)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        outputs = model(batch)
    F.mse_loss(outputs.float(), batch[1]).backward()  # type: ignore[no-untyped-call]
    return [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


def _as_parameters(weights: list[torch.Tensor], grads: list[torch.Tensor]) -> list[nn.Parameter]:
    """Parameters holding ``weights`` whose ``.grad`` is ``grads`` itself (clipping them clips ``grads``)."""
    parameters = []
    for weight, grad in zip(weights, grads, strict=True):
        parameter = nn.Parameter(weight.clone())
        parameter.grad = grad
        parameters.append(parameter)
    return parameters


def _total_norm(tensors: list[torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors])))


@pytest.mark.parametrize(("clipping_type", "threshold"), CASES)
def test_clipping_under_a_grad_scaler_clips_the_true_gradients(clipping_type: str, threshold: float) -> None:
    initial, recorder = _train(clipping_type, threshold)
    reference_model, data = copy.deepcopy(initial), _data()
    taken = 0
    for step in range(STEPS):
        if recorder.overflowed[step]:  # the scaled gradients overflowed: the scaler skips this step
            continue
        before, grads = recorder.before[step], recorder.grads[step]
        taken += 1
        index = step % BATCHES_PER_EPOCH
        true_grads = _reference_gradients(reference_model, before, data[index * BATCH : (index + 1) * BATCH])
        clipped = [grad.clone() for grad in true_grads]
        apply_gradient_clipping(_as_parameters(before, clipped), clipping_type, threshold)
        assert any(not torch.equal(g, c) for g, c in zip(true_grads, clipped, strict=True)), "nothing was clipped"
        for ours, expected in zip(grads, clipped, strict=True):
            torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-6)
        if clipping_type == "norm":
            assert _total_norm(true_grads) > 2 * threshold
            assert _total_norm(grads) == pytest.approx(threshold, rel=1e-4)
        elif clipping_type == "value":
            assert max(float(grad.abs().max()) for grad in grads) == pytest.approx(threshold)
    assert taken >= STEPS // 2


@pytest.mark.parametrize(("clipping_type", "threshold"), CASES)
def test_the_optimizer_steps_with_the_clipped_gradients_and_skips_overflows(
    clipping_type: str, threshold: float
) -> None:
    _, recorder = _train(clipping_type, threshold)
    assert any(recorder.overflowed) and not all(recorder.overflowed)
    for step in range(STEPS):
        before, grads, after = recorder.before[step], recorder.grads[step], recorder.after[step]
        if recorder.overflowed[step]:  # even where clipping made the gradients finite again ("value")
            assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True)), f"step {step} overflowed"
            continue
        for weight, grad, stepped in zip(before, grads, after, strict=True):  # SGD: w <- w - lr * clipped g
            torch.testing.assert_close(stepped, weight - LR * grad, rtol=0, atol=1e-6)


def test_deepspeed_is_refused_when_the_trainer_starts() -> None:
    state = State(model=Regressor(), max_duration=Time.from_timestring("1ba"))
    state.fabric = type("FabricOnDeepSpeed", (), {"strategy": DeepSpeedStrategy()})()
    with pytest.raises(ValueError, match=r"'gradient_clipping': 0.5 \(a norm\) in the DeepSpeed config"):
        Engine(state, None, [GradientClipping("norm", 0.5)]).run_event(Event.INIT)
