"""OptimizerMonitor: Composer's l2_norm/{grad,param,moment,update} names, each value checked against torch."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from monitor_rig import Regressor, Rig, fit
from torch import nn

from fabric.trainer.callbacks import OptimizerMonitor
from fabric.trainer.core.events import Event


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    model[0].bias.requires_grad_(False)  # frozen: never counted
    return model


def _train_batch(rig: Rig, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One batch as the Trainer runs it: gradients, AFTER_TRAIN_BATCH, step, zero_grad, clock, BATCH_END."""
    rig.run(Event.BATCH_START)
    model(torch.randn(5, 3)).pow(2).mean().backward()
    rig.run(Event.AFTER_TRAIN_BATCH)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    rig.advance()
    rig.run(Event.BATCH_END)


def _global(tensors: list[torch.Tensor]) -> float:
    return torch.linalg.vector_norm(torch.cat([tensor.flatten() for tensor in tensors])).item()


def test_grad_and_param_norms_are_torchs_before_the_step() -> None:
    model = _model()
    rig = Rig(OptimizerMonitor(log_per_layer=True), model=model)
    model(torch.randn(5, 3)).pow(2).mean().backward()
    rig.run(Event.AFTER_TRAIN_BATCH)
    trained = {name: parameter for name, parameter in model.named_parameters() if parameter.requires_grad}
    grad_norm = torch.nn.utils.clip_grad_norm_(list(trained.values()), max_norm=math.inf).item()
    values = rig.memory.most_recent_values
    assert values["l2_norm/grad/global"] == pytest.approx(grad_norm)
    assert values["l2_norm/param/global"] == pytest.approx(_global([p.detach() for p in trained.values()]))
    for name, parameter in trained.items():
        assert parameter.grad is not None
        assert values[f"l2_norm/grad/{name}"] == pytest.approx(torch.linalg.vector_norm(parameter.grad).item())
        assert values[f"l2_norm/param/{name}"] == pytest.approx(torch.linalg.vector_norm(parameter).item())
    assert "l2_norm/grad/0.bias" not in values and "l2_norm/param/0.bias" not in values
    assert rig.steps("l2_norm/grad/global") == [1]  # the batch being trained, next to its loss


def test_moment_norms_are_adams_first_moments_after_the_step() -> None:
    model = _model()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    rig = Rig(OptimizerMonitor(log_per_layer=True), model=model)
    rig.state.optimizers = [optimizer]
    _train_batch(rig, model, optimizer)
    _train_batch(rig, model, optimizer)
    moments = {name: optimizer.state[p]["exp_avg"] for name, p in model.named_parameters() if p.requires_grad}
    values = rig.memory.most_recent_values
    assert values["l2_norm/moment/global"] == pytest.approx(_global(list(moments.values())))
    for name, moment in moments.items():
        assert values[f"l2_norm/moment/{name}"] == pytest.approx(torch.linalg.vector_norm(moment).item())
    assert rig.steps("l2_norm/moment/global") == [1, 2]
    assert "l2_norm/update/global" not in values  # off unless asked: it copies the parameters


def test_moment_norms_read_sgds_momentum_and_skip_plain_sgd() -> None:
    model = _model()
    momentum = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)
    plain = torch.optim.SGD([model[0].weight], lr=0.1)
    rig = Rig(OptimizerMonitor(log_per_layer=True), model=model)
    rig.state.optimizers = [momentum, plain]
    rig.run(Event.BATCH_START)
    model(torch.randn(5, 3)).pow(2).mean().backward()
    momentum.step()
    plain.step()
    rig.advance()
    rig.run(Event.BATCH_END)
    values = rig.memory.most_recent_values
    assert values["l2_norm/moment/2.weight"] == pytest.approx(
        torch.linalg.vector_norm(momentum.state[model[2].weight]["momentum_buffer"]).item()
    )
    assert "l2_norm/moment/0.weight" not in values


def test_update_norms_are_what_the_step_changed() -> None:
    model = _model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1, weight_decay=0.5)
    rig = Rig(OptimizerMonitor(log_per_layer=True, log_update_norms=True), model=model)
    rig.state.optimizers = [optimizer]
    before = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    _train_batch(rig, model, optimizer)
    updates = {name: model.get_parameter(name).detach() - old for name, old in before.items()}
    values = rig.memory.most_recent_values
    for name, update in updates.items():
        assert values[f"l2_norm/update/{name}"] == pytest.approx(torch.linalg.vector_norm(update).item())
    assert values["l2_norm/update/global"] == pytest.approx(_global(list(updates.values())))
    assert values["l2_norm/update/global"] > 0


def test_batch_log_interval_logs_every_nth_batch_only() -> None:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    rig = Rig(OptimizerMonitor(batch_log_interval=2, log_update_norms=True), model=model)
    rig.state.optimizers = [optimizer]
    for _ in range(5):
        _train_batch(rig, model, optimizer)
    for kind in ("grad", "param", "moment", "update"):
        assert rig.steps(f"l2_norm/{kind}/global") == [2, 4], kind


def test_only_global_norms_without_log_per_layer_and_no_moments_when_not_asked() -> None:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    rig = Rig(OptimizerMonitor(log_optimizer_metrics=False), model=model)
    rig.state.optimizers = [optimizer]
    _train_batch(rig, model, optimizer)
    assert set(rig.memory.most_recent_values) == {"l2_norm/grad/global", "l2_norm/param/global"}


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"batch_log_interval": 0}, "batch_log_interval must be a whole number, at least 1; got 0"),
        ({"batch_log_interval": True}, "batch_log_interval must be a whole number"),
        ({"log_optimizer_metrics": "yes"}, "log_optimizer_metrics must be True or False; got 'yes'"),
        ({"log_per_layer": 1}, "log_per_layer must be True or False; got 1"),
    ],
)
def test_rejects_bad_arguments(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OptimizerMonitor(**arguments)


def test_in_a_fit_every_kind_is_logged_at_every_step_under_the_users_parameter_names() -> None:
    model = Regressor()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    memory = fit(model, [OptimizerMonitor(log_per_layer=True, log_update_norms=True)], optimizer=optimizer)
    for name in ("grad/global", "param/global", "moment/global", "update/global", "grad/net.0.weight"):
        assert [step for step, _ in memory.data[f"l2_norm/{name}"]] == [1, 2, 3, 4, 5, 6], name
    assert all(value > 0 for _, value in memory.data["l2_norm/update/net.2.bias"])
