"""GyroDropout: tau of sigma pre-selected masks per step, one per slice of the batch, switched every iter_num steps;
identity in eval; the training length from the Trainer; resumable; and an MLP that still learns with it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric.trainer.algorithms import GyroDropout
from fabric.trainer.algorithms.gyro_dropout import GyroDropoutLayer, apply_gyro_dropout, training_steps
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time


def test_in_eval_the_layer_is_the_identity() -> None:
    layer = GyroDropoutLayer(10, 2, p=0.5, sigma=8, tau=2).eval()
    x = torch.randn(4, 6)
    assert torch.equal(layer(x), x)
    assert layer.training_step == 0 and layer.preselect_masks is None


def test_each_slice_of_the_batch_uses_one_preselected_mask_scaled_by_the_keep_rate() -> None:
    torch.manual_seed(0)
    layer = GyroDropoutLayer(iters_per_epoch=10, max_epoch=1, p=0.25, sigma=8, tau=4)
    x = torch.ones(8, 64)
    output = layer(x)
    assert layer.preselect_masks is not None and layer.preselect_masks.shape == (8, 64)
    assert set(torch.unique(output).tolist()) <= {0.0, float(torch.tensor(1 / 0.75))}
    masks = (output > 0).float()
    for slice_ in masks.split(2):  # 8 samples, 4 masks: 2 consecutive samples per mask
        assert torch.equal(slice_[0], slice_[1])
        assert any(torch.equal(slice_[0], m.float()) for m in layer.preselect_masks)
    kept = layer.preselect_masks.float().mean()
    assert 0.6 < float(kept) < 0.9  # about 1 - p of the units are kept


def test_the_masks_in_use_change_only_every_iter_num_steps() -> None:
    torch.manual_seed(0)
    layer = GyroDropoutLayer(iters_per_epoch=10, max_epoch=2, p=0.5, sigma=16, tau=4)
    assert layer.iter_num == 5  # 20 steps * 4 masks per step / 16 masks: each mask is used about once
    x = torch.ones(4, 32)
    outputs = [layer(x) for _ in range(15)]
    for period in (outputs[0:5], outputs[5:10], outputs[10:15]):
        assert all(torch.equal(output, period[0]) for output in period)
    assert not (torch.equal(outputs[0], outputs[5]) and torch.equal(outputs[5], outputs[10]))
    assert GyroDropoutLayer(1, 1, sigma=256, tau=16).iter_num == 1  # at least one step


def test_any_batch_size_and_positions_share_the_sample_mask() -> None:
    torch.manual_seed(0)
    layer = GyroDropoutLayer(10, 1, p=0.5, sigma=4, tau=4)
    tokens = torch.ones(3, 5, 16)  # fewer samples than masks; 5 positions each
    output = layer(tokens)
    for sample in output:
        assert all(torch.equal(sample[0], position) for position in sample)
    with pytest.raises(ValueError, match="drew its masks for 16 features, but got an input with 8"):
        layer(torch.ones(3, 8))


def test_only_dropout_modules_are_replaced_and_a_model_without_any_gets_a_warning() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.Dropout2d(0.1), nn.Sequential(nn.Dropout(0.3)))
    assert list(apply_gyro_dropout(model, 10, 3, p=0.2, sigma=8, tau=2)) == ["1", "3.0"]
    assert isinstance(model[1], GyroDropoutLayer) and model[1].p == 0.2 and model[1].iter_num == 7
    assert type(model[2]) is nn.Dropout2d
    with pytest.warns(UserWarning, match="GyroDropout found no nn.Dropout in Linear"):
        assert apply_gyro_dropout(nn.Linear(2, 2), 10, 1) == {}


def test_the_training_length_comes_from_max_duration() -> None:
    state = State(model=nn.Linear(1, 1), max_duration=Time.from_input("3ep"), dataloader_len=7)
    assert training_steps(state) == (7, 3)
    state.max_duration = Time.from_input("50ba")
    assert training_steps(state) == (50, 1)
    state.max_duration = Time.from_input("1000sp")
    with pytest.raises(ValueError, match=r"max_duration in 'ep' .* or 'ba', got 1000sp"):
        training_steps(state)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"p": 1.0}, r"p=1.0 must be a drop probability in \[0, 1\)"),
        ({"p": -0.1}, "p=-0.1 must be a drop probability"),
        ({"sigma": 0}, "sigma=0 must be a positive integer"),
        ({"tau": 2.0}, "tau=2.0 must be a positive integer"),
    ],
)
def test_bad_arguments_fail_at_construction(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"GyroDropout: {message}"):
        GyroDropout(**arguments)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 3))

    def forward(self, batch: Any) -> torch.Tensor:
        output: torch.Tensor = self.net(batch[0])
        return output

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.cross_entropy(outputs, batch[1])


def _trainer(model: nn.Module, algorithm: GyroDropout, duration: str = "8ep") -> Any:
    from fabric.trainer.trainer import Trainer

    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(256, 8, generator=generator)
    targets = (inputs[:, :3] * torch.tensor([1.0, -1.0, 0.5])).argmax(1)
    return Trainer(
        model=model,
        train_dataloader=DataLoader(TensorDataset(inputs, targets), batch_size=32),
        max_duration=duration,
        optimizers=torch.optim.Adam(model.parameters(), lr=0.01),
        algorithms=[algorithm],
        progress_bar=False,
        seed=0,
        accelerator="cpu",
    ), (inputs, targets)


def test_an_mlp_learns_with_gyro_dropout() -> None:
    torch.manual_seed(0)
    model = MLP()
    algorithm = GyroDropout(p=0.5, sigma=16, tau=4)
    trainer, batch = _trainer(model, algorithm)
    with torch.no_grad():
        before = model.loss(model(batch), batch).item()
    trainer.fit()
    trainer.close()
    layer = model.net[2]
    assert isinstance(layer, GyroDropoutLayer)
    assert layer.iter_num == 8 * 8 * 4 // 16 and layer.training_step == 64
    model.eval()
    with torch.no_grad():
        after = model.loss(model(batch), batch).item()
    assert after < 0.5 * before, (before, after)


def test_the_masks_and_step_count_carry_over_to_a_resumed_run() -> None:
    torch.manual_seed(0)
    model = MLP()
    algorithm = GyroDropout(p=0.5, sigma=16, tau=4)
    trainer, _ = _trainer(model, algorithm, "1ep")
    trainer.fit()
    trainer.close()
    saved = algorithm.state_dict()
    assert saved["layers"][0]["training_step"] == 8

    resumed_algorithm = GyroDropout(p=0.5, sigma=16, tau=4)
    resumed_algorithm.load_state_dict(saved)  # before FIT_START: the layers do not exist yet
    resumed_model = MLP()
    trainer, _ = _trainer(resumed_model, resumed_algorithm, "1ep")
    trainer.fit()
    trainer.close()
    layer = resumed_model.net[2]
    assert isinstance(layer, GyroDropoutLayer) and layer.training_step == 16
    assert layer.preselect_masks is not None
    assert torch.equal(layer.preselect_masks, saved["layers"][0]["preselect_masks"])
