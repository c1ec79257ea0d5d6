"""A sharded save over the one already at a URL: ``python fsdp_remote_overwrite.py URL OUT [kill]``.

Two FSDP ranks save ``{"model", "step": 1}`` to URL, change the weights, and save ``step: 2`` over it. Rank 0 writes
each step's full weights to ``OUT/step{N}.pt`` before saving it. With ``kill``, rank 1 is SIGKILLed while it uploads
its shard of the second save, after the data went out and before the file was closed.
"""

import sys
from pathlib import Path

import torch
from upload_kill import die_during_shard_upload

from fabric import Fabric

url, out = sys.argv[1], Path(sys.argv[2])
kill = sys.argv[3:] == ["kill"]


fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=2)
fabric.launch()
if kill:
    die_during_shard_upload(rank=1, nth=2)
torch.manual_seed(0)
model = fabric.setup(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)))
for step in (1, 2):
    weights = {name: tensor.full_tensor() for name, tensor in model.state_dict().items()}
    if fabric.global_rank == 0:
        torch.save(weights, out / f"step{step}.pt")
    fabric.save(url, {"model": model, "step": step})
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
