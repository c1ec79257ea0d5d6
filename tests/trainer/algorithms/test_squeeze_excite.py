"""SqueezeExcite: blocks only after convs with min(in, out) >= min_channels, the paper's computation, the optimizer
gets the new parameters, a second application adds nothing, and a model still learns with it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from fabric.trainer.algorithms import SqueezeExcite
from fabric.trainer.algorithms.squeeze_excite import SqueezeExcite2d, SqueezeExciteConv2d, apply_squeeze_excite
from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.surgery import reapply_surgery, surgery_records


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),  # min(3, 16) = 3
        nn.Conv2d(16, 32, 3, padding=1),  # 16
        nn.Conv2d(32, 8, 1),  # 8
        nn.Conv2d(8, 64, 1),  # 8
    )


def test_blocks_are_added_only_where_both_channel_counts_reach_min_channels() -> None:
    model = _net()
    replaced = apply_squeeze_excite(model, latent_channels=4, min_channels=16)
    assert list(replaced) == ["1"]
    assert [type(m).__name__ for m in model] == ["Conv2d", "SqueezeExciteConv2d", "Conv2d", "Conv2d"]
    assert list(apply_squeeze_excite(_net(), latent_channels=4, min_channels=8)) == ["1", "2", "3"]
    assert list(apply_squeeze_excite(_net(), latent_channels=4, min_channels=0)) == ["0", "1", "2", "3"]
    assert apply_squeeze_excite(_net(), latent_channels=4, min_channels=17) == {}


def test_latent_channels_are_a_count_or_a_fraction_of_the_output_channels() -> None:
    assert SqueezeExcite2d(64, latent_channels=16).latent_channels == 16
    assert SqueezeExcite2d(64, latent_channels=0.25).latent_channels == 16
    assert SqueezeExcite2d(4, latent_channels=0.1).latent_channels == 1  # at least one unit
    wrapped = SqueezeExciteConv2d(nn.Conv2d(8, 32, 1), latent_channels=0.5)
    assert wrapped.se.pool_and_mlp[2].weight.shape == (16, 32)


def test_a_block_scales_each_channel_by_the_sigmoid_of_an_mlp_of_the_channel_means() -> None:
    torch.manual_seed(0)
    block = SqueezeExcite2d(6, latent_channels=3)
    x = torch.randn(2, 6, 5, 4)
    down, up = block.pool_and_mlp[2].weight, block.pool_and_mlp[4].weight
    assert isinstance(down, torch.Tensor) and isinstance(up, torch.Tensor)
    scale = torch.sigmoid(torch.relu(x.mean(dim=(2, 3)) @ down.T) @ up.T)
    torch.testing.assert_close(block(x), x * scale[:, :, None, None])


def test_the_conv_keeps_its_parameters_and_the_optimizer_gets_the_new_ones() -> None:
    model = _net()
    conv = model[1]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    apply_squeeze_excite(model, latent_channels=4, min_channels=16, optimizers=[optimizer])
    assert model[1].conv is conv
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in model.parameters()}
    assert "1.conv.weight" in model.state_dict() and "1.se.pool_and_mlp.2.weight" in model.state_dict()


def test_applying_twice_adds_no_second_block() -> None:
    model = _net()
    apply_squeeze_excite(model, latent_channels=4, min_channels=16)
    assert apply_squeeze_excite(model, latent_channels=4, min_channels=16) == {}
    assert sum(isinstance(m, SqueezeExcite2d) for m in model.modules()) == 1


def test_a_checkpointed_surgery_replays_on_a_fresh_model() -> None:
    model = _net()
    algorithm = SqueezeExcite(latent_channels=0.5, min_channels=8)
    algorithm.apply_surgery(model)
    fresh = _net()
    reapply_surgery(fresh, surgery_records([algorithm]))
    fresh.load_state_dict(model.state_dict())
    x = torch.randn(1, 3, 4, 4)
    torch.testing.assert_close(fresh(x), model(x))


def test_a_model_without_a_wide_enough_conv_gets_a_warning() -> None:
    with pytest.warns(
        UserWarning, match=r"SqueezeExcite found no nn.Conv2d with min\(in_channels, out_channels\) >= 128"
    ):
        SqueezeExcite().apply_surgery(_net())


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"latent_channels": 0}, "latent_channels=0 must be a positive number"),
        ({"latent_channels": -0.5}, "latent_channels=-0.5 must be a positive number"),
        ({"min_channels": -1}, "min_channels=-1 must be a non-negative integer"),
        ({"min_channels": 2.5}, "min_channels=2.5 must be a non-negative integer"),
    ],
)
def test_bad_arguments_fail_at_construction(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SqueezeExcite(**arguments)


def test_a_model_still_learns_with_squeeze_excite(
    accuracy_after_training: Callable[[Sequence[Algorithm]], float],
) -> None:
    assert accuracy_after_training([SqueezeExcite(latent_channels=0.25, min_channels=8)]) > 0.6
