"""Collectives on N ranks (``python ddp_collectives.py OUT_DIR N``); each rank saves what it computed."""

import sys
from pathlib import Path

import torch

from fabric import Fabric

out_dir = Path(sys.argv[1])
fabric = Fabric(accelerator="cpu", strategy="ddp", devices=int(sys.argv[2]))
fabric.launch()
rank, world = fabric.global_rank, fabric.world_size
results = {
    "gather": fabric.all_gather(torch.full((2, 3), float(rank))),
    "gather_collection": fabric.all_gather({"a": torch.tensor(rank), "b": [torch.ones(1) * rank]}),
    "gather_uneven": fabric.all_gather(torch.arange(rank + 1)),
    "sum": fabric.all_reduce(torch.tensor(float(rank + 1)), reduce_op="sum"),
    "int_mean": fabric.all_reduce(torch.tensor(rank), reduce_op="mean"),
    "max": fabric.all_reduce(torch.tensor([rank, -rank]), reduce_op="max"),
    "min": fabric.all_reduce(rank + 10, reduce_op="min"),
    "broadcast": fabric.broadcast({"from": rank, "tensor": torch.tensor([rank])}, src=world - 1),
}
grad_input = torch.ones(2, requires_grad=True)
gathered = fabric.all_gather(grad_input * (rank + 1), sync_grads=True)
gathered.sum().backward()
results["sync_grads"] = grad_input.grad

# Gradient accumulation: inside no_backward_sync each rank keeps its own gradient; the next backward
# outside it averages the accumulated sums across ranks.
torch.manual_seed(0)
model = fabric.setup(torch.nn.Linear(3, 1, bias=False))
inputs = torch.full((1, 3), float(rank + 1))
with fabric.no_backward_sync(model):
    model(inputs).sum().backward()
results["grad_unsynced"] = model.module.weight.grad.clone()
fabric.backward(model(inputs).sum())
results["grad_synced"] = model.module.weight.grad.clone()

# Checkpoints: rank 0 writes, every rank reads.
checkpoint = out_dir / "shared.pt"
fabric.save(checkpoint, {"model": model, "written_by": rank})
state = {"model": model, "written_by": -1}
fabric.load(checkpoint, state)
results["loaded_from"] = state["written_by"]
fabric.barrier("done")
out_dir.mkdir(parents=True, exist_ok=True)
torch.save(results, out_dir / f"rank{rank}.pt")
