"""SAM: the step's gradient equals a hand-computed SAM gradient, with or without microbatches; bad combinations fail."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fabric.trainer.algorithms.label_smoothing import LabelSmoothing
from fabric.trainer.algorithms.mixup import MixUp
from fabric.trainer.algorithms.sam import SAM
from fabric.trainer.core.engine import Engine
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time, Timestamp


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(3, 4), nn.Linear(4, 1)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(batch[0])))

    def loss(self, outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(outputs, batch[1])


def _gradient(model: nn.Module, batch: Any, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The loss gradient at ``weights``, computed functionally (the model is not touched)."""
    names = [name for name, _ in model.named_parameters()]
    params = {name: w.detach().clone().requires_grad_(True) for name, w in zip(names, weights, strict=True)}
    loss = F.mse_loss(torch.func.functional_call(model, params, (batch,)), batch[1])
    return list(torch.autograd.grad(loss, list(params.values())))


def _sam_gradient(model: nn.Module, batch: Any, rho: float) -> list[torch.Tensor]:
    weights = [p.detach() for p in model.parameters()]
    grads = _gradient(model, batch, weights)
    norm = torch.sqrt(sum((g**2).sum() for g in grads))  # type: ignore[arg-type]
    return _gradient(model, batch, [w + rho * g / norm for w, g in zip(weights, grads, strict=True)])


@pytest.mark.parametrize("microbatch_size", [None, 2])
def test_the_step_gradient_is_the_sam_gradient_and_weights_are_restored(microbatch_size: int | None) -> None:
    torch.manual_seed(0)
    model, batch = Regression(), (torch.randn(5, 3), torch.randn(5, 1))
    expected = _sam_gradient(model, batch, rho=0.3)
    weights_before = [p.detach().clone() for p in model.parameters()]
    state = State(model=model, max_duration=Time.from_timestring("10ba"), device_train_microbatch_size=microbatch_size)
    state.batch = batch
    model.loss(model(batch), batch).backward()  # the trainer's own pass
    Engine(state, None, [SAM(rho=0.3, epsilon=1e-12)]).run_event(Event.AFTER_TRAIN_BATCH)
    for parameter, grad, before in zip(model.parameters(), expected, weights_before, strict=True):
        torch.testing.assert_close(parameter.grad, grad)
        assert torch.equal(parameter.detach(), before)


def test_interval_skips_the_batches_in_between() -> None:
    torch.manual_seed(0)
    model, batch = Regression(), (torch.randn(5, 3), torch.randn(5, 1))
    state = State(model=model, max_duration=Time.from_timestring("10ba"))
    state.batch, state.timestamp = batch, Timestamp(batch=1)
    model.loss(model(batch), batch).backward()
    plain = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    Engine(state, None, [SAM(rho=0.3, interval=2)]).run_event(Event.AFTER_TRAIN_BATCH)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain, strict=True))  # type: ignore[arg-type]


def test_sam_uses_the_fabric_backward_and_syncs_only_the_last_microbatch() -> None:
    torch.manual_seed(0)
    model, batch = Regression(), (torch.randn(4, 3), torch.randn(4, 1))
    calls: list[tuple[str, bool]] = []

    def backward(loss: torch.Tensor, model: nn.Module) -> None:
        calls.append(("backward", True))
        loss.backward()

    @contextlib.contextmanager
    def no_backward_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
        calls.append(("no_sync", enabled))
        yield

    precision = SimpleNamespace(scales_gradients=False)
    fabric = SimpleNamespace(
        backward=backward, no_backward_sync=no_backward_sync, strategy=SimpleNamespace(precision=precision)
    )
    state = State(model=model, max_duration=Time.from_timestring("10ba"), fabric=fabric, device_train_microbatch_size=2)
    state.batch = batch
    model.loss(model(batch), batch).backward()
    Engine(state, None, [SAM()]).run_event(Event.AFTER_TRAIN_BATCH)
    assert calls == [("no_sync", True), ("backward", True), ("no_sync", False), ("backward", True)]


def test_a_grad_scaler_is_rejected_when_the_trainer_is_built() -> None:
    from fabric.trainer.trainer import Trainer

    model = Regression()
    with pytest.raises(ValueError, match=r"SAM cannot run with a GradScaler \(precision '16-mixed'\)"):
        Trainer(
            model=model,
            max_duration="1ep",
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            algorithms=[SAM()],
            progress_bar=False,
            accelerator="cpu",
            precision="16-mixed",
        )


@pytest.mark.parametrize("other", [MixUp(), LabelSmoothing()])
def test_algorithms_bypassed_by_the_recomputation_are_incompatible(other: Any) -> None:
    state = State(model=Regression(), max_duration=Time.from_timestring("10ba"))
    with pytest.raises(ValueError, match=f"SAM cannot run together with {type(other).__name__}"):
        Engine(state, None, [SAM(), other])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"rho": 0.0}, "rho=0.0"), ({"epsilon": -1.0}, "epsilon=-1.0"), ({"interval": 0}, "interval=0")],
)
def test_bad_arguments_fail_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SAM(**kwargs)
