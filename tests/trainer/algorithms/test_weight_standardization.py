"""WeightStandardization: convolutions see weights of zero mean and unit std per output channel."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from fabric.trainer.algorithms import WeightStandardization
from fabric.trainer.algorithms.weight_standardization import apply_weight_standardization
from fabric.trainer.core.algorithm import Algorithm


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3), nn.Conv1d(6, 4, 1), nn.Conv3d(4, 5, 2), nn.Linear(5, 2))


def test_each_output_channel_has_zero_mean_and_unit_std_and_the_parameters_are_kept() -> None:
    model = _model()
    with torch.no_grad():
        model[0].weight.mul_(7).add_(3)
    raw = [model[i].weight for i in range(3)]
    assert apply_weight_standardization(model) == ["0", "1", "2"]
    for index, original in enumerate(raw):
        weight = model[index].weight
        per_channel = weight.flatten(1)
        torch.testing.assert_close(per_channel.mean(dim=1), torch.zeros(weight.shape[0]), atol=1e-5, rtol=0)
        torch.testing.assert_close(per_channel.std(dim=1, correction=0), torch.ones(weight.shape[0]), atol=1e-3, rtol=0)
        assert model[index].parametrizations.weight.original is original  # the optimizer's parameter
    assert not parametrize.is_parametrized(model[3])
    assert "0.parametrizations.weight.original" in model.state_dict()


def test_the_standardised_weight_is_used_in_the_forward() -> None:
    model = _model()
    conv = model[0]
    images = torch.randn(2, 3, 5, 5)
    raw = conv.weight.detach().clone()
    apply_weight_standardization(model)
    mean = raw.mean(dim=(1, 2, 3), keepdim=True)
    var = raw.var(dim=(1, 2, 3), keepdim=True, correction=0)
    expected = nn.functional.conv2d(images, (raw - mean) / torch.sqrt(var + 1e-5), conv.bias)
    torch.testing.assert_close(conv(images), expected)


def test_the_last_layers_can_be_left_alone() -> None:
    model = _model()
    assert apply_weight_standardization(model, n_last_layers_ignore=2) == ["0"]
    model = _model()
    assert apply_weight_standardization(model, n_last_layers_ignore=5) == []


def test_bad_arguments_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="n_last_layers_ignore must be a non-negative integer, got -1"):
        WeightStandardization(n_last_layers_ignore=-1)


def test_a_model_still_learns_with_weight_standardization(
    accuracy_after_training: Callable[[Sequence[Algorithm]], float],
) -> None:
    assert accuracy_after_training([WeightStandardization()]) > 0.6
