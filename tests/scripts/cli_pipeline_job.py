"""Started by ``fabric run model --mesh=pipeline_parallel=2,data_parallel=2``: the script gives only the cut
(``PipelinePlan``), no mesh and no device count; the CLI's mesh places the stages and the data shares. Each data
share trains its half of every batch of tests/scripts/pipeline_job_reference.py (3 SGD steps, no clipping); each
rank writes ``OUT/rank-R.pt``: the mesh it got, its stage, the losses averaged over the shares, the whole weights."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from pipeline_job_reference import STEPS, batches, make_model

from fabric import Fabric
from fabric.strategies import ModelParallelStrategy, PipelinePlan

fabric = Fabric(strategy=ModelParallelStrategy(pipeline=PipelinePlan(["2"], F.mse_loss, microbatches=2)))
fabric.launch()
model = make_model()
model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
shares, share = fabric.strategy.data_parallel_shard
losses = []
for inputs, targets in batches()[:STEPS]:
    loss = model(inputs.chunk(shares)[share], target=targets.chunk(shares)[share])  # the loss reaches every stage
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
report = {
    "mesh": fabric.strategy.mesh_plan().as_text(),  # type: ignore[attr-defined]
    "data_parallel_shard": (shares, share),
    "losses": losses,
    "weights": {name: value.full_tensor().detach() for name, value in model.module.state_dict().items()},
}
torch.save(report, Path(sys.argv[1]) / f"rank-{fabric.global_rank}.pt")
