"""fp8-mixed jobs for tests/plugins/precision/test_float8.py: ``python float8_job.py OUT_DIR MODE [ARG]``.

``reference [HALVES]``: one process trains the tiny language model in fp8-mixed, each step's batch as ``HALVES``
(default 2) parts whose gradients accumulate (float8's activation scales are per forward, so 2 is what two data-
parallel ranks compute, 1 what tensor-parallel ranks compute). ``fsdp [ALL_GATHER]``: two ranks under FSDP2 each
train on their half (``ALL_GATHER`` 1: the weights all-gathered in float8), save a sharded checkpoint, and load it
into a fresh model. ``tp``: two ranks split each block's Linear pair (Colwise, Rowwise) and train on the whole batch.
Rank 0 writes the losses, the final full weights, the layer types and (fsdp) the reloaded weights to
``OUT_DIR/report.pt``. Needs ``tests/`` on ``PYTHONPATH`` (for ``float8_model``).
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from float8_model import TinyLM
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fabric import Fabric
from fabric.plugins.precision.float8 import Float8Precision
from fabric.strategies import ModelParallelStrategy

STEPS, VOCAB, RANKS = 6, 64, 2  # VOCAB: TinyLM's default


def split_blocks(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Tensor parallelism: each block's up projection column-wise, its down projection row-wise."""
    plan = {f"blocks.{index}.{layer}": style for index in range(2) for layer, style in
            (("1", ColwiseParallel()), ("3", RowwiseParallel()))}  # fmt: skip
    return parallelize_module(model, mesh["tensor_parallel"], plan)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return TinyLM()


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    def full(tensor: torch.Tensor) -> torch.Tensor:
        return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().float().clone()

    return {name: full(value) for name, value in model.state_dict().items()}


out_dir, mode = Path(sys.argv[1]), sys.argv[2]
argument = sys.argv[3] if len(sys.argv) > 3 else None
batches = torch.randint(0, VOCAB, (STEPS, RANKS * 8, 17), generator=torch.Generator().manual_seed(1))
losses = []
if mode == "reference":
    parts = int(argument or RANKS)
    fabric = Fabric(accelerator="cpu", precision="fp8-mixed")
    module = make_model()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.5))
    for batch in batches:
        step_loss = 0.0
        for part in batch.chunk(parts):
            loss = loss_of(model, part) / parts
            fabric.backward(loss)
            step_loss += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    torch.save({"losses": losses, "weights": full_weights(model)}, out_dir / "report.pt")
else:
    if mode == "fsdp":
        strategy: str | ModelParallelStrategy = "fsdp"
        plugin = Float8Precision(fsdp_float8_all_gather=argument == "1")
    else:
        strategy = ModelParallelStrategy(split_blocks, data_parallel_size=1, tensor_parallel_size=RANKS)
        plugin = Float8Precision()
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=RANKS, plugins=[plugin])
    fabric.launch()
    module = make_model()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)  # built before setup: Fabric re-points it
    model, optimizer = fabric.setup(module, optimizer)
    for batch in batches:
        loss = loss_of(model, batch.chunk(RANKS)[fabric.global_rank] if mode == "fsdp" else batch)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    layer_types = sorted({type(layer).__name__ for layer in model.modules() if isinstance(layer, nn.Linear)})
    report = {"losses": losses, "weights": full_weights(model), "layer_types": layer_types}
    if mode == "fsdp":
        checkpoint = out_dir / "checkpoint"
        fabric.save(checkpoint, {"model": model, "optimizer": optimizer})
        fresh = fabric.setup_module(make_model())
        fabric.load(checkpoint, {"model": fresh})
        report["reloaded"] = full_weights(fresh)
    if fabric.global_rank == 0:
        torch.save(report, out_dir / "report.pt")
