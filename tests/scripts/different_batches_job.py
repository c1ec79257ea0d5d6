"""Two ranks that hold parts of one model copy are fed different batches, as a loader sharding itself by RANK would
do; for tests/strategies/test_same_batches.py.

``python different_batches_job.py OUT tensor|pipeline``: ``ModelParallelStrategy`` over 2 CPU ranks with a
tensor-parallel degree of 2 (a Colwise/Rowwise MLP) or 2 pipeline stages; each rank draws its batch from a seed of
its own rank. Each rank writes ``OUT/rank-R.txt``: the first forward's error message, or ``trained`` if none came.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fabric import Fabric
from fabric.strategies import MeshPlan, ModelParallelStrategy, PipelinePlan

out_dir, kind = Path(sys.argv[1]), sys.argv[2]


def parallelize(model: nn.Module, mesh: object) -> nn.Module:
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    return parallelize_module(model, mesh["tensor_parallel"], plan)  # type: ignore[index]


if kind == "tensor":
    strategy = ModelParallelStrategy(parallelize, mesh=MeshPlan(data_parallel=1, tensor_parallel=2))
else:
    pipeline = PipelinePlan(["2"], F.mse_loss, microbatches=2)
    strategy = ModelParallelStrategy(mesh=MeshPlan(pipeline_parallel=2, data_parallel=1), pipeline=pipeline)
fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
fabric.launch()
torch.manual_seed(0)
model = fabric.setup(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
generator = torch.Generator().manual_seed(fabric.global_rank)  # what a loader sharding over every rank gives
inputs, targets = torch.randn(4, 4, generator=generator), torch.randn(4, 2, generator=generator)
try:
    for _ in range(2):
        loss = model(inputs, target=targets) if kind == "pipeline" else F.mse_loss(model(inputs), targets)
        fabric.backward(loss)
    result = "trained"
except ValueError as error:
    result = str(error)
(out_dir / f"rank-{fabric.global_rank}.txt").write_text(result)
