"""A 2-rank DDP training job for the tests: ``python ddp_train.py OUT_DIR [STRATEGY] [DEVICES]``.

Each rank saves its parameters, losses and data shard to ``OUT_DIR/rank{R}.pt``.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric

out_dir = Path(sys.argv[1])
strategy = sys.argv[2] if len(sys.argv) > 2 else "ddp"
devices = int(sys.argv[3]) if len(sys.argv) > 3 else 2

fabric = Fabric(accelerator="cpu", strategy=strategy, devices=devices)
fabric.launch()
torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = fabric.setup(model, optimizer)
x = torch.randn(64, 6, generator=torch.Generator().manual_seed(1))
y = x.sum(dim=1, keepdim=True).sin()
dataset = TensorDataset(torch.arange(64), x, y)
loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=32 // fabric.world_size))
seen, losses = [], []
for _ in range(3):
    for index, inputs, target in loader:
        seen.extend(index.tolist())
        loss = F.mse_loss(model(inputs), target)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        losses.append(fabric.all_reduce(loss.detach()).item())
out_dir.mkdir(parents=True, exist_ok=True)
torch.save(
    {
        "rank": fabric.global_rank,
        "world_size": fabric.world_size,
        "params": [p.detach().clone() for p in model.parameters()],
        "seen": seen,
        "losses": losses,
    },
    out_dir / f"rank{fabric.global_rank}.pt",
)
