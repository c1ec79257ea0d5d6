"""DecoupledSGDW and DecoupledAdamW: weight decay decoupled from the gradient step and scaled by lr / initial_lr."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from fabric.trainer.optimizers import DecoupledAdamW, DecoupledSGDW

_GRADIENTS = [torch.tensor([0.5, -1.0, 2.0]), torch.tensor([-0.25, 0.75, 1.0]), torch.tensor([1.0, 1.0, -3.0])]
_LEARNING_RATES = [0.1, 0.05, 0.025]  # a schedule halving the learning rate each step


def _run(optimizer: torch.optim.Optimizer, weight: torch.nn.Parameter) -> list[list[float]]:
    trajectory = []
    for gradient, lr in zip(_GRADIENTS, _LEARNING_RATES, strict=True):
        for group in optimizer.param_groups:
            group["lr"] = lr
        weight.grad = gradient.clone()
        optimizer.step()
        trajectory.append(weight.detach().tolist())
    return trajectory


def test_sgdw_decays_by_the_schedule_then_steps_with_momentum() -> None:
    weight = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    got = _run(DecoupledSGDW([weight], lr=0.1, momentum=0.9, weight_decay=0.01), weight)
    expected, w, buffer = [], torch.tensor([1.0, -2.0, 3.0]), None
    for gradient, lr in zip(_GRADIENTS, _LEARNING_RATES, strict=True):
        w = w * (1 - 0.01 * lr / 0.1)  # the decay follows the schedule: 1%, then 0.5%, then 0.25%
        buffer = gradient.clone() if buffer is None else 0.9 * buffer + gradient
        w = w - lr * buffer
        expected.append(w.tolist())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected))


def test_adamw_is_adam_with_a_decay_scaled_by_lr_over_initial_lr_not_by_lr() -> None:
    weight = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    got = _run(DecoupledAdamW([weight], lr=0.1, weight_decay=0.01), weight)
    expected, w = [], torch.tensor([1.0, -2.0, 3.0])
    m, v = torch.zeros(3), torch.zeros(3)
    for step, (gradient, lr) in enumerate(zip(_GRADIENTS, _LEARNING_RATES, strict=True), start=1):
        w = w * (1 - 0.01 * lr / 0.1)
        m, v = 0.9 * m + 0.1 * gradient, 0.95 * v + 0.05 * gradient**2  # Composer's betas (0.9, 0.95)
        denominator = (v.sqrt() / math.sqrt(1 - 0.95**step)) + 1e-8
        w = w - (lr / (1 - 0.9**step)) * m / denominator
        expected.append(w.tolist())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected))
    torch_weight = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    torch_adamw = torch.optim.AdamW([torch_weight], lr=0.1, betas=(0.9, 0.95), weight_decay=0.01)
    assert _run(torch_adamw, torch_weight)[0] != got[0]  # torch's decays by lr * weight_decay = 0.1%, not 1%


def test_a_groups_own_weight_decay_is_kept_and_the_torch_step_never_decays_again() -> None:
    decayed, bias = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    optimizer = DecoupledSGDW(
        [{"params": [decayed]}, {"params": [bias], "weight_decay": 0.0}], lr=1.0, weight_decay=0.5
    )
    decayed.grad, bias.grad = torch.zeros(2), torch.zeros(2)
    optimizer.step()
    assert decayed.tolist() == [0.5, 0.5] and bias.tolist() == [1.0, 1.0]
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.0, 0.0]
    added = torch.nn.Parameter(torch.ones(2))
    optimizer.add_param_group({"params": [added]})  # a group added later gets the default decay
    added.grad = torch.zeros(2)
    optimizer.step()
    assert added.tolist() == [0.5, 0.5]


def test_the_state_dict_carries_the_decay_and_initial_lr_and_resumes_identically() -> None:
    weight = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    optimizer = DecoupledAdamW([weight], lr=0.1, weight_decay=0.01)
    weight.grad = _GRADIENTS[0].clone()
    optimizer.step()
    optimizer.param_groups[0]["lr"] = 0.05
    saved, saved_weight = copy.deepcopy(optimizer.state_dict()), weight.detach().clone()
    assert saved["param_groups"][0]["initial_lr"] == 0.1 and saved["param_groups"][0]["decoupled_weight_decay"] == 0.01
    resumed_weight = torch.nn.Parameter(saved_weight.clone())
    resumed = DecoupledAdamW([resumed_weight], lr=0.3, weight_decay=0.2)
    resumed.load_state_dict(saved)
    for each, parameter in ((optimizer, weight), (resumed, resumed_weight)):
        parameter.grad = _GRADIENTS[1].clone()
        each.step()
    assert torch.equal(weight, resumed_weight)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda p: DecoupledSGDW(p, lr=-0.1), r"DecoupledSGDW\(lr=-0.1\) is not valid. Accepted: a number >= 0"),
        (lambda p: DecoupledSGDW(p, lr=0.1, weight_decay=-1), r"DecoupledSGDW\(weight_decay=-1\)"),
        (lambda p: DecoupledAdamW(p, eps=float("nan")), r"DecoupledAdamW\(eps=nan\)"),
    ],
)
def test_bad_values_are_refused_naming_them(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build([torch.nn.Parameter(torch.ones(1))])  # type: ignore[operator]
