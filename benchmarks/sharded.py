"""Memory per rank and step time of DDP vs FSDP vs model parallel (and DeepSpeed ZeRO-2/3) on 2 CPU ranks.

Each strategy runs the same job in its own 2-rank process group (``python benchmarks/sharded.py --job
STRATEGY``, started by this script): an MLP of ``--layers`` square ``--width`` layers, Adam, batch 32
per rank, ``--steps`` steps of which the first 5 are warm-up. ``model_parallel`` is tensor parallelism
over both ranks (layers alternately Colwise and Rowwise, so each pair needs one all-reduce) with FSDP2 on
the data-parallel dimension of size 1; its ranks share one batch of 64, the global batch of the others.
Per rank it measures

* **state MB**: bytes of this rank's parameters + gradients + optimizer state tensors (local shards
  for FSDP), taken after the last step; the larger of the two ranks is shown. For DeepSpeed this
  count would miss ZeRO's flat partitioned buffers, so it is shown as ``n/a``;
* **max RSS MB**: peak resident memory of the rank's process (``getrusage``), the larger rank;
* **step ms**: median wall time of a step after warm-up, the slower rank.

Ratios are against DDP. Usage::

    python benchmarks/sharded.py                    # width 1024, 6 layers, 30 steps
    python benchmarks/sharded.py --width 2048 --steps 20
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import statistics
import sys
import time
from typing import Any

from job_results import print_result, run_for_result

STRATEGIES = ("ddp", "fsdp", "model_parallel", "deepspeed_stage_2", "deepspeed_stage_3")
RESULT_PREFIX = "SHARDED_RESULT "
WARMUP = 5


def _available(strategy: str) -> bool:
    from fabric.strategies.registry import STRATEGY_REGISTRY

    if strategy not in STRATEGY_REGISTRY:
        return False
    return not strategy.startswith("deepspeed") or importlib.util.find_spec("deepspeed") is not None


def _local_bytes(tensor: Any) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return int(local.numel() * local.element_size())


def _state_bytes(model: Any, optimizer: Any) -> int:
    import torch

    total = 0
    for parameter in model.parameters():
        total += _local_bytes(parameter)
        if parameter.grad is not None:
            total += _local_bytes(parameter.grad)
    for entry in optimizer.state.values():
        total += sum(_local_bytes(value) for value in entry.values() if isinstance(value, torch.Tensor))
    return total


def _tensor_parallel(model: Any, mesh: Any) -> Any:
    """Alternate Colwise and Rowwise over the Linear layers (``parallelize_fn`` of ``model_parallel``)."""
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    linears = [name for name, module in model.named_children() if isinstance(module, nn.Linear)]
    linears = linears[: len(linears) // 2 * 2]  # an odd last layer stays whole
    plan = {name: ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i, name in enumerate(linears)}
    return parallelize_module(model, mesh["tensor_parallel"], plan)


def run_job(strategy: str, width: int, layers: int, steps: int) -> None:
    """One rank of the job; rank 0 prints the result line."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from fabric import Fabric
    from fabric.strategies.model_parallel import ModelParallelStrategy

    chosen: Any = ModelParallelStrategy(_tensor_parallel) if strategy == "model_parallel" else strategy
    fabric = Fabric(accelerator="cpu", strategy=chosen, devices=2)
    fabric.launch()
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*blocks)
    if strategy == "fsdp":
        fabric.strategy.shard_modules = {nn.Linear}  # type: ignore[attr-defined]
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-4))
    x = torch.randn(64 if strategy == "model_parallel" else 32, width)
    times = []
    for _ in range(steps):
        fabric.barrier()
        start = time.perf_counter()
        loss = F.mse_loss(model(x), x)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        times.append(time.perf_counter() - start)
    state = torch.tensor(float(_state_bytes(model, optimizer)))
    rss = torch.tensor(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # kB on Linux
    step = torch.tensor(statistics.median(times[WARMUP:]))
    result = {
        "state_mb": fabric.all_reduce(state, reduce_op="max").item() / 2**20,
        "rss_mb": fabric.all_reduce(rss, reduce_op="max").item(),
        "step_ms": fabric.all_reduce(step, reduce_op="max").item() * 1e3,
    }
    if fabric.is_global_zero:
        print_result(RESULT_PREFIX, result)


def _measure(strategy: str, args: argparse.Namespace) -> dict[str, float] | str:
    command = [sys.executable, __file__, "--job", strategy]
    command += ["--width", str(args.width), "--layers", str(args.layers), "--steps", str(args.steps)]
    return run_for_result(command, RESULT_PREFIX)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--job", choices=STRATEGIES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        run_job(args.job, args.width, args.layers, args.steps)
        return
    params = args.layers * (args.width * args.width + args.width)
    print(f"MLP {args.layers}x{args.width} ({params / 1e6:.1f} M parameters), Adam, 2 CPU ranks (gloo)")
    print(f"{'strategy':<20}{'state MB':>10}{'x DDP':>8}{'max RSS MB':>12}{'x DDP':>8}{'step ms':>10}{'x DDP':>8}")
    baseline: dict[str, float] | None = None
    for strategy in STRATEGIES:
        if not _available(strategy):
            print(f"{strategy:<20}not available")
            continue
        result = _measure(strategy, args)
        if isinstance(result, str):
            print(f"{strategy:<20}{result}")
            continue
        baseline = baseline or result
        state = "n/a" if strategy.startswith("deepspeed") else f"{result['state_mb']:.1f}"
        state_ratio = "" if strategy.startswith("deepspeed") else f"{result['state_mb'] / baseline['state_mb']:.2f}"
        print(
            f"{strategy:<20}{state:>10}{state_ratio:>8}"
            f"{result['rss_mb']:>12.0f}{result['rss_mb'] / baseline['rss_mb']:>8.2f}"
            f"{result['step_ms']:>10.1f}{result['step_ms'] / baseline['step_ms']:>8.2f}"
        )


if __name__ == "__main__":
    main()
