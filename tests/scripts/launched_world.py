"""What a Fabric sees and trains under a real launcher: ``launched_world.py OUT_DIR [KEY=VALUE ...]``.

``KEY=VALUE`` pairs become ``Fabric(...)`` arguments (``devices=1``, ``strategy=single_device``); none gives a
default ``Fabric()``. Each rank trains one epoch over 16 samples and writes ``rankR.json``: its place in the job,
the torch rank variables it has after ``launch()``, the samples it saw and its final parameters.
"""

import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric

VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
             "GLOO_SOCKET_IFNAME")  # fmt: skip

out_dir = Path(sys.argv[1])
arguments = dict(argument.split("=", 1) for argument in sys.argv[2:])
fabric = Fabric(accelerator="cpu", **arguments)
fabric.launch()
torch.manual_seed(0)
model = torch.nn.Linear(1, 1)
model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
inputs = torch.arange(16, dtype=torch.float32).unsqueeze(1)
loader = fabric.setup_dataloaders(DataLoader(TensorDataset(inputs, 2 * inputs), batch_size=2))
seen = []
for x, y in loader:
    seen += x.flatten().int().tolist()
    optimizer.zero_grad()
    fabric.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()
report = {
    "rank": fabric.global_rank,
    "local_rank": fabric.local_rank,
    "node_rank": fabric.node_rank,
    "world_size": fabric.world_size,
    "strategy": type(fabric.strategy).__name__,
    "environment": type(getattr(fabric.strategy, "cluster_environment", None)).__name__,
    "variables": {name: os.environ.get(name) for name in VARIABLES},
    "seen": seen,
    "parameters": [p.item() for p in model.parameters()],
}
(out_dir / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))
