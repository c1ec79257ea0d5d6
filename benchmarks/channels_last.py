"""ChannelsLast on CPU: the training step of a small ResNet in each memory format, in one run.

The workaround in ``fabric/trainer/algorithms/channels_last.py`` computes strided 1x1 convolutions as
a subsampled input through a unit-stride convolution, because torch 2.13's oneDNN AVX2 kernel for the
strided case corrupts memory. This measures what that costs against the alternatives:

- ``contiguous``: the model as built (NCHW), the baseline;
- ``channels_last, routed``: :func:`apply_channels_last`, what the ChannelsLast algorithm does;
- ``channels_last, oneDNN off``: the other safe option, taking oneDNN out entirely;
- ``channels_last, unrouted``: the plain ``model.to(memory_format=torch.channels_last)``; only run where
  oneDNN uses AVX-512 kernels (on AVX2 kernels it crashes the process).

Each variant trains ``benchmarks/algorithms.py``'s SmallResNet (width 16, 3x32x32 images, batch 64,
SGD, one thread) from the same weights, in interleaved rounds; the table gives the median step time
and the ratio to the contiguous step. Run it twice to see both kernel families::

    python benchmarks/channels_last.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/channels_last.py
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algorithms import SmallResNet

from fabric.trainer.algorithms.channels_last import apply_channels_last


def _avx512_kernels() -> bool:
    """Whether oneDNN runs its AVX-512 kernels here (the unrouted variant is safe only then)."""
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "ALL")).upper()
    cpu_has_avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    return cpu_has_avx512 and (capped in ("ALL", "DEFAULT") or capped.startswith(("AVX512", "AVX10")))


def _variants(base: nn.Module) -> dict[str, tuple[nn.Module, bool, bool]]:
    """name -> (model, channels-last input, oneDNN enabled)."""
    variants = {
        "contiguous": (copy.deepcopy(base), False, True),
        "channels_last, routed": (apply_channels_last(copy.deepcopy(base)), True, True),
        "channels_last, oneDNN off": (
            cast(Any, copy.deepcopy(base)).to(memory_format=torch.channels_last),
            True,
            False,
        ),
    }
    if _avx512_kernels():
        unrouted = cast(Any, copy.deepcopy(base)).to(memory_format=torch.channels_last)
        variants["channels_last, unrouted"] = (unrouted, True, True)
    return variants


def _timed_steps(model: nn.Module, channels_last: bool, onednn: bool, steps: int) -> float:
    """Median seconds per training step over ``steps`` steps on fixed random data."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    images, labels = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    times = []
    torch.backends.mkldnn.enabled = onednn
    try:
        for _ in range(steps):
            start = time.perf_counter()
            loss = F.cross_entropy(model((images, labels)), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            times.append(time.perf_counter() - start)
    finally:
        torch.backends.mkldnn.enabled = True
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 3 steps")
    arguments = parser.parse_args()
    rounds, steps = (2, 3) if arguments.quick else (arguments.rounds, arguments.steps)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    variants = _variants(SmallResNet(width=16))
    timings: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(rounds):
        names = list(variants)
        names = names[round_index % len(names) :] + names[: round_index % len(names)]  # rotate against drift
        for name in names:
            model, channels_last, onednn = variants[name]
            timings[name].append(_timed_steps(model, channels_last, onednn, steps))
    baseline = statistics.median(timings["contiguous"])
    kernels = "AVX-512" if _avx512_kernels() else "AVX2"
    print(f"ChannelsLast step, SmallResNet width 16, batch 64, 1 thread, oneDNN {kernels} kernels")
    print(f"| {'variant':28s} | {'ms/step':>8s} | {'ratio':>6s} |")
    print(f"|{'-' * 30}|{'-' * 10}|{'-' * 8}|")
    for name, values in timings.items():
        median = statistics.median(values)
        print(f"| {name:28s} | {median * 1e3:8.2f} | {median / baseline:5.2f}x |")


if __name__ == "__main__":
    main()
