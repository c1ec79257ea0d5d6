"""ActivationMonitor: Composer's activations/<statistic>/<module>_{input,output}.<n> names, values by hand."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch
from monitor_rig import Regressor, Rig, fit
from torch import nn

from fabric.trainer.callbacks import ActivationMonitor
from fabric.trainer.core.events import Event
from fabric.trainer.loggers import WandBLogger


def _model() -> nn.Sequential:
    """``ReLU(x @ W.T + b)`` with weights that make the output easy to compute by hand."""
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
        model[0].bias.copy_(torch.tensor([0.0, -5.0, 1.0]))
    return model


X = torch.tensor([[1.0, 2.0], [3.0, -4.0]])


def _forward(rig: Rig, model: nn.Module, batch: Any) -> None:
    rig.run(Event.BEFORE_FORWARD)
    model(batch)
    rig.run(Event.AFTER_FORWARD)


def test_statistics_equal_the_hand_computed_ones() -> None:
    model = _model()
    rig = Rig(ActivationMonitor(interval=1), model=model)
    _forward(rig, model, X)
    values = rig.memory.most_recent_values
    # Linear output rows: [1, -3, 4] and [3, -9, 0]; after ReLU: [1, 0, 4] and [3, 0, 0].
    assert values["activations/max/0_output.0"] == pytest.approx((4 + 3) / 2)  # mean of the rows' maxima
    assert values["activations/max/1_output.0"] == pytest.approx((4 + 3) / 2)
    assert values["activations/average/0_output.0"] == pytest.approx((1 - 3 + 4 + 3 - 9 + 0) / 6)
    assert values["activations/average/1_output.0"] == pytest.approx((1 + 4 + 3) / 6)
    assert values["activations/l2_norm/1_output.0"] == pytest.approx(((1 + 16) ** 0.5 + 3) / 2)
    assert values["activations/max/full_model_input.0"] == pytest.approx((2 + 3) / 2)
    assert values["activations/l2_norm/full_model_input.0"] == pytest.approx((5**0.5 + 5) / 2)
    assert values["activations/max/0_input.0"] == values["activations/max/full_model_input.0"]
    # Kurtosis of a row with two equal values and one apart, [1, 0, 4]: m4 / m2^2 over the row.
    row = torch.tensor([1.0, 0.0, 4.0])
    centred = row - row.mean()
    expected_first = (centred**4).mean() / (centred**2).mean() ** 2
    second = torch.tensor([3.0, 0.0, 0.0]) - 1.0
    expected_second = (second**4).mean() / (second**2).mean() ** 2
    assert values["activations/kurtosis/1_output.0"] == pytest.approx(((expected_first + expected_second) / 2).item())
    assert rig.steps("activations/max/1_output.0") == [1]  # the step of the batch being trained
    names = {name.split("/", 2)[2] for name in values}
    assert names == {"full_model_input.0", "full_model_output.0", "0_input.0", "0_output.0", "1_input.0", "1_output.0"}


def test_hooks_run_only_on_the_first_forward_of_every_interval_and_are_removed() -> None:
    model = _model()
    rig = Rig(ActivationMonitor(interval="2ba"), model=model)
    for _ in range(5):  # batches 0 to 4: logged at 0, 2 and 4
        rig.run(Event.BATCH_START)
        for _microbatch in range(2):
            _forward(rig, model, X)
            assert all(not module._forward_hooks for module in model.modules())
        rig.advance()
        rig.run(Event.BATCH_END)
    assert rig.steps("activations/max/1_output.0") == [1, 3, 5]


def test_nested_inputs_name_their_positions_and_integer_tensors_are_skipped() -> None:
    class TakesDicts(nn.Module):
        def forward(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
            return batch["x"] * 2, [batch["x"] + 1, batch["labels"]]

    model = TakesDicts()
    rig = Rig(ActivationMonitor(interval=1), model=model)
    _forward(rig, model, {"x": X, "labels": torch.tensor([1, 0])})
    maxima = {
        name: value for name, value in rig.memory.most_recent_values.items() if name.startswith("activations/max")
    }
    assert maxima == {
        "activations/max/full_model_0_input.0": pytest.approx(2.5),  # the dict's first value, x
        "activations/max/full_model_output.0": pytest.approx(5.0),
        "activations/max/full_model_0_output.1": pytest.approx(3.5),  # the list's first item, x + 1
    }


def test_ignore_module_types_by_name_fragment_or_class() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0), nn.ReLU())
    rig = Rig(ActivationMonitor(interval=1, ignore_module_types=["full_model", nn.ReLU]), model=model)
    _forward(rig, model, X)
    names = {name.split("/", 2)[2] for name in rig.memory.most_recent_values}
    assert names == {"0_input.0", "0_output.0", "1_input.0", "1_output.0"}


def test_an_epoch_interval_logs_the_first_batch_of_those_epochs() -> None:
    model = _model()
    rig = Rig(ActivationMonitor(interval="2ep"), model=model)
    for _epoch in range(3):
        for _batch in range(2):
            _forward(rig, model, X)
            rig.advance()
        rig.state.timestamp = rig.state.timestamp.to_next_epoch()
    assert rig.steps("activations/average/1_output.0") == [1, 5]  # epochs 0 and 2


class RecordingWandB(WandBLogger):
    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[dict[str, float], int]] = []

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.logged.append((dict(metrics), step))


@pytest.mark.parametrize("only_log_wandb", [True, False])
def test_only_log_wandb_sends_to_the_wandb_loggers_alone(only_log_wandb: bool) -> None:
    model, wandb = _model(), RecordingWandB()
    rig = Rig(ActivationMonitor(interval=1, only_log_wandb=only_log_wandb), model=model, destinations=(wandb,))
    _forward(rig, model, X)
    ((metrics, step),) = wandb.logged
    assert metrics["activations/max/1_output.0"] == pytest.approx(3.5) and step == 1
    assert ("activations/max/1_output.0" in rig.memory.most_recent_values) is not only_log_wandb


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"interval": 0}, "interval=0 is not an interval; accepted: a positive 'Nba' or 'Nep', or an int"),
        ({"interval": "0.5dur"}, "interval='0.5dur' is not an interval"),
        ({"ignore_module_types": "dropout"}, "ignore_module_types must be a list"),
        ({"ignore_module_types": [int]}, "ignore_module_types must be a list"),
        ({"only_log_wandb": None}, "only_log_wandb must be True or False"),
    ],
)
def test_rejects_bad_arguments(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ActivationMonitor(**arguments)


def test_in_a_fit_the_batch_and_every_layer_are_logged_every_interval() -> None:
    memory = fit(Regressor(), [ActivationMonitor(interval=2, only_log_wandb=False)])
    # The Trainer calls model((x, y)): x is the batch's first item; y only reaches the model's input.
    for name in ("full_model_0_input.0", "full_model_1_input.0", "net.0_output.0", "net.2_output.0"):
        assert [step for step, _ in memory.data[f"activations/l2_norm/{name}"]] == [1, 3, 5], name
