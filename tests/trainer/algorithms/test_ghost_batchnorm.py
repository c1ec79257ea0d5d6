"""GhostBatchNorm: per-ghost-batch normalisation in training, exactly the original BatchNorm in evaluation."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn

from fabric.trainer.algorithms import GhostBatchNorm
from fabric.trainer.algorithms.ghost_batchnorm import (
    GhostBatchNorm1d,
    GhostBatchNorm2d,
    GhostBatchNorm3d,
    apply_ghost_batchnorm,
)
from fabric.trainer.core.algorithm import Algorithm


def _trained_batchnorm(kind: type[nn.modules.batchnorm._BatchNorm], shape: tuple[int, ...]) -> nn.Module:
    torch.manual_seed(0)
    batchnorm = kind(shape[1])
    with torch.no_grad():
        batchnorm.weight.uniform_(0.5, 2.0)
        batchnorm.bias.normal_()
    for _ in range(3):
        batchnorm(torch.randn(shape) * 3 + 1)  # running statistics away from their initial values
    return batchnorm


SHAPES = [(nn.BatchNorm1d, (12, 4)), (nn.BatchNorm1d, (12, 4, 5)), (nn.BatchNorm2d, (12, 4, 3, 3))]
SHAPES += [(nn.BatchNorm3d, (12, 4, 2, 2, 2))]


@pytest.mark.parametrize(("kind", "shape"), SHAPES)
def test_in_eval_a_ghost_batchnorm_is_exactly_the_batchnorm_it_replaced(
    kind: type[nn.modules.batchnorm._BatchNorm], shape: tuple[int, ...]
) -> None:
    model = nn.Sequential(_trained_batchnorm(kind, shape)).eval()
    original = copy.deepcopy(model)
    apply_ghost_batchnorm(model, ghost_batch_size=4)
    assert type(model[0]) is {1: GhostBatchNorm1d, 2: GhostBatchNorm2d, 3: GhostBatchNorm3d}[int(kind.__name__[-2])]
    images = torch.randn(shape)
    assert torch.equal(model(images), original(images))
    assert list(model.state_dict()) == list(original.state_dict())


@pytest.mark.parametrize(("kind", "shape"), SHAPES)
def test_in_training_each_ghost_batch_is_normalised_with_its_own_statistics(
    kind: type[nn.modules.batchnorm._BatchNorm], shape: tuple[int, ...]
) -> None:
    model = nn.Sequential(_trained_batchnorm(kind, shape)).train()
    reference = copy.deepcopy(model[0])
    apply_ghost_batchnorm(model, ghost_batch_size=4)
    inputs = torch.randn(shape) * 2 - 1
    ghost_output = model(inputs)
    # each slice of 4 samples normalised alone by a plain BatchNorm with the same affine parameters
    slices = [copy.deepcopy(reference)(chunk) for chunk in inputs.split(4)]
    torch.testing.assert_close(ghost_output, torch.cat(slices))
    # the full batch normalised at once differs: the statistics really are per ghost batch
    assert not torch.allclose(ghost_output, copy.deepcopy(reference)(inputs), atol=1e-3)


def test_running_statistics_take_one_momentum_step_towards_the_mean_ghost_statistics() -> None:
    batchnorm = nn.BatchNorm2d(3, momentum=0.25)
    ghost = GhostBatchNorm2d.from_batchnorm(batchnorm, ghost_batch_size=2)
    inputs = torch.randn(6, 3, 4, 4) + torch.arange(6.0).view(6, 1, 1, 1)
    ghost(inputs)
    chunks = inputs.split(2)
    ghost_mean = torch.stack([chunk.mean(dim=(0, 2, 3)) for chunk in chunks]).mean(0)
    ghost_var = torch.stack([chunk.var(dim=(0, 2, 3)) for chunk in chunks]).mean(0)
    torch.testing.assert_close(batchnorm.running_mean, 0.25 * ghost_mean)  # shared with the ghost module
    torch.testing.assert_close(batchnorm.running_var, 0.75 * torch.ones(3) + 0.25 * ghost_var)
    assert int(batchnorm.num_batches_tracked) == 1


def test_uneven_batches_are_cut_into_near_equal_ghost_batches() -> None:
    ghost = GhostBatchNorm1d.from_batchnorm(nn.BatchNorm1d(2), ghost_batch_size=4)
    inputs = torch.randn(9, 2)  # 3 ghost batches of 3
    torch.testing.assert_close(ghost(inputs), torch.cat([nn.BatchNorm1d(2)(chunk) for chunk in inputs.split(3)]))


def test_parameters_stay_the_same_objects_so_optimizers_keep_training_them() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2))
    parameters = list(model.parameters())
    GhostBatchNorm(ghost_batch_size=2).apply_surgery(model)
    assert all(new is old for new, old in zip(model.parameters(), parameters, strict=True))


@pytest.mark.parametrize("size", [0, -3, 2.5, True])
def test_a_bad_ghost_batch_size_fails_at_construction(size: object) -> None:
    with pytest.raises(ValueError, match=f"ghost_batch_size must be a positive integer, got {size!r}"):
        GhostBatchNorm(ghost_batch_size=size)  # type: ignore[arg-type]


def test_a_model_still_learns_with_ghost_batchnorm(
    accuracy_after_training: Callable[[Sequence[Algorithm]], float],
) -> None:
    assert accuracy_after_training([GhostBatchNorm(ghost_batch_size=16)]) > 0.6
