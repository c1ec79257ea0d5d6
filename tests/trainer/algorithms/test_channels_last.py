"""ChannelsLast: the model's 4-d tensors become NHWC at INIT; results and optimizers are unaffected."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

import pytest
import torch

from fabric.trainer.algorithm import Algorithm
from fabric.trainer.algorithms import ChannelsLast
from fabric.trainer.engine import Engine
from fabric.trainer.events import Event
from fabric.trainer.state import State
from fabric.trainer.time import Time

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


_STRIDED_POINTWISE_GRADIENTS = """
import sys

import torch
from torch import nn

from fabric.trainer.algorithms.channels_last import apply_channels_last

torch.set_num_threads(int(sys.argv[1]))
torch.manual_seed(0)
worst = 0.0
for in_channels, stride, size in [(3, 2, 8), (4, 2, 8), (4, 3, 15), (4, 4, 8), (16, 2, 16)]:
    for _ in range(3):
        reference = nn.Sequential(nn.Conv2d(in_channels, 8, 1, stride=stride, bias=False)).double()
        model = apply_channels_last(nn.Sequential(nn.Conv2d(in_channels, 8, 1, stride=stride, bias=False)))
        model[0].weight.data.copy_(reference[0].weight)
        images = torch.randn(8, in_channels, size, size, dtype=torch.float64)
        reference(images).square().sum().backward()
        model(images.float().contiguous(memory_format=torch.channels_last)).square().sum().backward()
        expected = reference[0].weight.grad
        worst = max(worst, ((model[0].weight.grad.double() - expected).abs().max() / expected.abs().max()).item())
print(worst)
"""


@pytest.mark.parametrize("threads", [1, 2])
def test_strided_pointwise_convs_get_right_gradients_on_avx2_kernels(threads: int) -> None:
    """torch 2.13's oneDNN AVX2 kernel for this case corrupts the heap (1 thread) or the gradient (2 threads);
    ChannelsLast routes around it. ONEDNN_MAX_CPU_ISA=AVX2 makes an AVX-512 machine use that kernel."""
    result = subprocess.run(
        [sys.executable, "-c", _STRIDED_POINTWISE_GRADIENTS, str(threads)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout) < 1e-5
