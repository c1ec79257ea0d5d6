"""Factorize: SVD-initialised low-rank pairs, exact at full rank, the best rank-r product below it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn

from fabric.trainer.algorithms import Factorize
from fabric.trainer.algorithms.factorize import FactorizedConv2d, FactorizedLinear, apply_factorization
from fabric.trainer.core.algorithm import Algorithm


def _truncated_svd(matrix: torch.Tensor, rank: int) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    return (u[:, :rank] * s[:rank]) @ vh[:rank]


def test_a_full_rank_factorized_linear_reproduces_the_original() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(12, 7)
    inputs = torch.randn(5, 12)
    factorized = FactorizedLinear.from_original(linear, rank=7)
    torch.testing.assert_close(factorized(inputs), linear(inputs), atol=1e-5, rtol=1e-5)


def test_a_full_rank_factorized_conv_reproduces_the_original() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 3, stride=2, padding=1, dilation=1)
    images = torch.randn(2, 3, 9, 9)
    factorized = FactorizedConv2d.from_original(conv, rank=8)  # full rank: min(8, 3 * 3 * 3)
    torch.testing.assert_close(factorized(images), conv(images), atol=1e-5, rtol=1e-5)


def test_a_lower_rank_linear_computes_the_truncated_svd_product() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(10, 9)
    factorized = FactorizedLinear.from_original(linear, rank=3)
    product = factorized.second.weight.double() @ factorized.first.weight.double()
    torch.testing.assert_close(product, _truncated_svd(linear.weight.detach(), 3), atol=1e-6, rtol=1e-5)
    inputs = torch.randn(4, 10)
    expected = inputs.double() @ _truncated_svd(linear.weight.detach(), 3).T + linear.bias.double()
    torch.testing.assert_close(factorized(inputs).double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.linalg.matrix_rank(product).item() == 3


def test_a_lower_rank_conv_computes_the_truncated_svd_product() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 8, 3, padding=1)
    factorized = FactorizedConv2d.from_original(conv, rank=4)
    approximation = _truncated_svd(conv.weight.detach().flatten(1), 4).view_as(conv.weight).float()
    images = torch.randn(2, 6, 7, 7)
    expected = nn.functional.conv2d(images, approximation, conv.bias, padding=1)
    torch.testing.assert_close(factorized(images), expected, atol=1e-5, rtol=1e-5)


def test_only_layers_large_enough_to_save_work_are_factorized_and_optimizers_follow() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3),  # 3 input channels < min_channels
        nn.Conv2d(32, 32, 3),  # factorized: rank 8
        nn.Conv2d(32, 32, 3, groups=2),  # grouped: left alone
        nn.Flatten(),
        nn.Linear(32, 32),  # factorized: rank 8
        nn.Linear(32, 4),  # 4 output features < min_features
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    replaced = apply_factorization(model, [optimizer], min_channels=16, min_features=16)
    assert list(replaced) == ["1", "4"]
    assert model[1].first.out_channels == 8 and model[4].first.out_features == 8
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == {id(p) for p in model.parameters()}


def test_a_rank_that_saves_nothing_leaves_the_layer_alone() -> None:
    model = nn.Sequential(nn.Linear(16, 16))
    assert apply_factorization(model, latent_features=8, min_features=4) == {}  # 8 * (16 + 16) == 16 * 16


def test_an_integer_latent_size_is_a_count_and_a_fraction_is_a_share_of_the_smaller_side() -> None:
    model = nn.Sequential(nn.Linear(64, 40), nn.Linear(40, 64))
    apply_factorization(model, latent_features=5, min_features=4)
    assert model[0].first.out_features == 5
    model = nn.Sequential(nn.Linear(64, 40))
    apply_factorization(model, latent_features=0.1, min_features=4)
    assert model[0].first.out_features == 4


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"latent_channels": 0.0}, "latent_channels must be a fraction in \\(0, 1\\] or a positive integer, got 0.0"),
        ({"latent_features": 1.5}, "latent_features must be a fraction in \\(0, 1\\] or a positive integer, got 1.5"),
        ({"latent_features": 0}, "latent_features .* got 0"),
        ({"min_channels": 0}, "min_channels must be a positive integer, got 0"),
        ({"factorize_convs": False, "factorize_linears": False}, "would change nothing"),
    ],
)
def test_bad_arguments_fail_at_construction(arguments: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Factorize(**arguments)  # type: ignore[arg-type]


def test_a_rank_above_the_full_rank_is_rejected() -> None:
    with pytest.raises(ValueError, match="rank must be between 1 and 3 for a \\(3, 5\\) weight, got 4"):
        FactorizedLinear.from_original(nn.Linear(5, 3), rank=4)


def test_a_model_still_learns_with_factorize(accuracy_after_training: Callable[[Sequence[Algorithm]], float]) -> None:
    algorithm = Factorize(min_channels=8, latent_channels=0.5, min_features=8, latent_features=0.5)
    # Chance is 0.1. The half-rank model learns slower than the full one (0.96); its cosine LR now decays every batch
    # (as in Composer) instead of once per epoch, which leaves it at 0.596 after 3 epochs.
    assert accuracy_after_training([algorithm]) > 0.5
