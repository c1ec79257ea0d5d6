"""Weight gradients of strided 1x1 convolutions on channels-last data, computed in a child process on oneDNN's AVX2
kernels, whose weight gradient for this case torch 2.13 gets wrong (torch-workaround onednn-avx2-strided-1x1-grad):
a native crash there fails the caller, not the test session. ``ONEDNN_MAX_CPU_ISA=AVX2`` makes an AVX-512 machine use
the AVX2 kernels."""

from __future__ import annotations

import os
import subprocess
import sys

_WORST_GRADIENT_ERROR = """
import sys

import torch
from torch import nn

from fabric.trainer.algorithms.channels_last import apply_channels_last

torch.set_num_threads(int(sys.argv[1]))
routed = sys.argv[2] == "routed"
torch.manual_seed(0)
worst = 0.0
for in_channels, stride, size in [(3, 2, 8), (4, 2, 8), (4, 3, 15), (4, 4, 8), (16, 2, 16)]:
    for _ in range(3):
        reference = nn.Sequential(nn.Conv2d(in_channels, 8, 1, stride=stride, bias=False)).double()
        model = nn.Sequential(nn.Conv2d(in_channels, 8, 1, stride=stride, bias=False))
        model = apply_channels_last(model) if routed else model.to(memory_format=torch.channels_last)
        model[0].weight.data.copy_(reference[0].weight)
        images = torch.randn(8, in_channels, size, size, dtype=torch.float64)
        reference(images).square().sum().backward()
        model(images.float().contiguous(memory_format=torch.channels_last)).square().sum().backward()
        expected = reference[0].weight.grad
        worst = max(worst, ((model[0].weight.grad.double() - expected).abs().max() / expected.abs().max()).item())
print(worst)
"""


def strided_pointwise_gradients(threads: int, routed: bool) -> subprocess.CompletedProcess[str]:
    """Run the convolutions on ``threads`` threads, converted by ``apply_channels_last`` (``routed``) or by a bare
    ``.to(memory_format=torch.channels_last)``; stdout is the worst relative error of their weight gradients
    against float64 contiguous ones."""
    return subprocess.run(
        [sys.executable, "-c", _WORST_GRADIENT_ERROR, str(threads), "routed" if routed else "plain"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    )
