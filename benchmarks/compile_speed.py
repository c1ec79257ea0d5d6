"""Step time of ``torch.compile`` vs eager, in a plain PyTorch loop and through Fabric, on CPU.

Four loops train identically initialised copies of one MLP (``--width`` wide, ``--layers`` hidden layers,
ReLU, batch ``--batch``) with SGD + momentum on the same synthetic batch:

* **plain eager**: ``loss = mse(model(x), y); zero_grad(); loss.backward(); step()``;
* **plain compiled**: the same with ``torch.compile(model)``;
* **fabric eager**: ``fabric.setup(model, optimizer)`` and ``fabric.backward``;
* **fabric compiled**: ``fabric.setup(model, optimizer, compile=True)``.

Each loop is warmed up first (that is when compilation happens; its time is shown as ``first steps s``;
the second compiled loop finds the first one's graph in dynamo's cache, so its first steps are short).
Then all four are timed in ``--rounds`` interleaved rounds of ``--steps`` steps, the order rotating each
round so the machine's load hits them alike. The table shows the median wall and CPU milliseconds per
step over the rounds, and ratios of the CPU times to plain eager and to the same loop's eager twin. By
default torch runs one thread (``--threads``): then CPU time does not count the time a busy shared
machine keeps the process waiting, so the ratios hold under load, where wall times scatter. Usage::

    python benchmarks/compile_speed.py                       # 512 wide, 4 layers, batch 128
    python benchmarks/compile_speed.py --width 1024 --batch 256
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fabric import Fabric

Step = Callable[[], None]
LOOPS = ("plain eager", "plain compiled", "fabric eager", "fabric compiled")
WARMUP_STEPS = 3


def _mlp(width: int, layers: int) -> nn.Module:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(width, 16))


def _plain_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Step:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return step


def _fabric_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, compile: bool) -> Step:
    fabric = Fabric(accelerator="cpu", devices=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer, compile=compile)

    def step() -> None:
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()

    return step


def _time(step: Step, steps: int) -> tuple[float, float]:
    """Wall and CPU seconds per step."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="steps per round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    base = _mlp(args.width, args.layers)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, 16)
    steps = {
        "plain eager": _plain_step(copy.deepcopy(base), x, y),
        "plain compiled": _plain_step(torch.compile(copy.deepcopy(base)), x, y),  # type: ignore[arg-type]
        "fabric eager": _fabric_step(copy.deepcopy(base), x, y, compile=False),
        "fabric compiled": _fabric_step(copy.deepcopy(base), x, y, compile=True),
    }
    first = {name: _time(step, WARMUP_STEPS)[0] * WARMUP_STEPS for name, step in steps.items()}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in LOOPS}
    for round_index in range(args.rounds):
        order = LOOPS[round_index % len(LOOPS) :] + LOOPS[: round_index % len(LOOPS)]
        for name in order:
            times[name].append(_time(steps[name], args.steps))
    wall = {name: statistics.median(t[0] for t in values) * 1e3 for name, values in times.items()}
    cpu = {name: statistics.median(t[1] for t in values) * 1e3 for name, values in times.items()}

    params = sum(p.numel() for p in base.parameters())
    print(
        f"MLP {args.layers}x{args.width} ({params / 1e6:.1f} M parameters), batch {args.batch}, CPU, "
        f"{torch.get_num_threads()} threads; median of {args.rounds} rounds x {args.steps} steps; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'loop':<18}{'first steps s':>14}{'wall ms':>9}{'cpu ms':>9}{'x plain eager':>15}{'x own eager':>13}")
    for name in LOOPS:
        own_eager = cpu[name.replace("compiled", "eager")]
        print(
            f"{name:<18}{first[name]:>14.1f}{wall[name]:>9.1f}{cpu[name]:>9.1f}"
            f"{cpu[name] / cpu['plain eager']:>15.2f}{cpu[name] / own_eager:>13.2f}"
        )


if __name__ == "__main__":
    main()
