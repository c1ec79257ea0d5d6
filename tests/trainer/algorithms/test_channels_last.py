"""ChannelsLast: the model's 4-d tensors become NHWC at INIT; results and optimizers are unaffected."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType

import pytest
import torch
from strided_pointwise import strided_pointwise_gradients

from fabric.trainer.algorithms import ChannelsLast
from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.engine import Engine
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time

# Channels-last convolutions hit a native kernel that crashed on AVX2-only CPUs (torch 2.13): each test runs
# in a forked child, so a crash fails one test instead of aborting the suite (tests/isolation.py).
pytestmark = pytest.mark.isolated


def test_init_converts_conv_weights_to_channels_last_and_keeps_outputs(image_task: ModuleType) -> None:
    torch.manual_seed(0)
    model = image_task.SmallResNet(width=8).eval()
    images = torch.randn(2, 3, 16, 16)
    expected = model(images)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    conv_weight = model.net[0].weight
    assert not conv_weight.is_contiguous(memory_format=torch.channels_last)
    state = State(model=model, max_duration=Time.from_timestring("1ep"), optimizers=[optimizer])
    Engine(state, None, [ChannelsLast()]).run_event(Event.INIT)
    assert model.net[0].weight is conv_weight  # same Parameter: the optimizer still holds it
    assert conv_weight.is_contiguous(memory_format=torch.channels_last)
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in model.parameters() if p.dim() == 4)
    torch.testing.assert_close(model(images), expected)


def test_a_model_still_learns_with_channels_last(
    accuracy_after_training: Callable[[Sequence[Algorithm]], float],
) -> None:
    assert accuracy_after_training([ChannelsLast()]) > 0.6


@pytest.mark.parametrize("threads", [1, 2])
def test_strided_pointwise_convs_get_right_gradients_on_avx2_kernels(threads: int) -> None:
    """torch 2.13's oneDNN AVX2 kernel for this case corrupts the heap (1 thread) or the gradient (2 threads);
    ChannelsLast routes around it."""
    result = strided_pointwise_gradients(threads, routed=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout) < 1e-5
