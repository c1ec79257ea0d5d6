"""BlurPool: which modules it replaces, that shapes and parameters survive, and what the blur computes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn

from fabric.trainer.algorithms import BlurPool
from fabric.trainer.algorithms.blurpool import BlurConv2d, MaxBlurPool2d, apply_blurpool, blur_2d
from fabric.trainer.core.algorithm import Algorithm


def _model() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),  # 0: strided but 3 < min_channels input channels
        nn.Conv2d(16, 16, 3, padding=1),  # 1: not strided
        nn.Conv2d(16, 32, 3, stride=2, padding=1),  # 2: replaced
        nn.MaxPool2d(3, stride=2, padding=1),  # 3: replaced
        nn.MaxPool2d(3, stride=1, padding=1),  # 4: not strided
        nn.Conv2d(32, 8, 1, stride=(1, 2)),  # 5: replaced (strided along one axis)
        nn.Conv2d(8, 8, 5, stride=3, padding=2),  # 6: 8 < 16 input channels
    )


@pytest.mark.parametrize("blur_first", [True, False])
def test_exactly_the_strided_convs_and_maxpools_are_replaced_and_shapes_are_kept(blur_first: bool) -> None:
    torch.manual_seed(0)
    model = _model()
    images = torch.randn(2, 3, 23, 18)
    shapes = [model[: index + 1](images).shape for index in range(len(model))]
    weights = [p for p in model.parameters()]
    replaced = apply_blurpool(model, blur_first=blur_first)
    assert list(replaced) == ["2", "3", "5"]
    assert [type(module) for module in model] == [
        nn.Conv2d,
        nn.Conv2d,
        BlurConv2d,
        MaxBlurPool2d,
        nn.MaxPool2d,
        BlurConv2d,
        nn.Conv2d,
    ]
    assert [model[: index + 1](images).shape for index in range(len(model))] == shapes
    assert all(new is old for new, old in zip(model.parameters(), weights, strict=True))  # optimizers unaffected
    assert list(model.state_dict()) == list(_model().state_dict())


def test_min_channels_and_the_replace_flags_select_the_modules() -> None:
    model = _model()
    assert list(apply_blurpool(model, replace_maxpools=False, min_channels=0)) == ["0", "2", "5", "6"]
    model = _model()
    assert list(apply_blurpool(model, replace_convs=False)) == ["3"]


def test_blur_is_the_binomial_filter_and_keeps_constants() -> None:
    impulse = torch.zeros(1, 1, 5, 5)
    impulse[0, 0, 2, 2] = 16.0
    expected = torch.tensor([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]])
    torch.testing.assert_close(blur_2d(impulse)[0, 0, 1:4, 1:4], expected)
    assert blur_2d(impulse).sum().item() == pytest.approx(16.0)
    constant = torch.full((2, 3, 7, 6), 2.5)
    torch.testing.assert_close(blur_2d(constant, stride=2), torch.full((2, 3, 4, 3), 2.5))


def test_blurred_conv_is_the_conv_of_the_blurred_input_or_the_blur_of_the_dense_conv() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, 3, stride=2, padding=1)
    images = torch.randn(2, 4, 9, 9)
    torch.testing.assert_close(BlurConv2d.from_conv(conv, blur_first=True)(images), conv(blur_2d(images)))
    dense = nn.functional.conv2d(images, conv.weight, conv.bias, padding=1)
    torch.testing.assert_close(BlurConv2d.from_conv(conv, blur_first=False)(images), blur_2d(dense, stride=2))


def test_maxblurpool_is_the_strided_blur_of_the_dense_maxpool() -> None:
    images = torch.randn(2, 3, 8, 8)
    dense = nn.functional.max_pool2d(images, 2, stride=1)
    torch.testing.assert_close(MaxBlurPool2d.from_maxpool(nn.MaxPool2d(2))(images), blur_2d(dense, stride=2))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"replace_convs": False, "replace_maxpools": False}, "would change nothing"),
        ({"min_channels": -1}, "min_channels must be a non-negative integer, got -1"),
    ],
)
def test_bad_arguments_fail_at_construction(arguments: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BlurPool(**arguments)  # type: ignore[arg-type]


def test_a_model_without_strided_layers_gets_a_warning() -> None:
    with pytest.warns(UserWarning, match="BlurPool found no strided Conv2d"):
        BlurPool().apply_surgery(nn.Sequential(nn.Conv2d(16, 16, 3)))


def test_a_model_still_learns_with_blurpool(accuracy_after_training: Callable[[Sequence[Algorithm]], float]) -> None:
    assert accuracy_after_training([BlurPool(min_channels=8)]) > 0.6
