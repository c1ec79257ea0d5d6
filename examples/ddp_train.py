"""One training script, three ways to start it on 2 CPU processes (gloo):

    python examples/ddp_train.py --devices 2                                   # Fabric starts rank 1 itself
    python examples/ddp_train.py --devices 2 --strategy ddp_spawn              # ... by spawning it
    torchrun --nproc_per_node=2 examples/ddp_train.py --devices 2              # torchrun starts both ranks
    srun --ntasks-per-node=2 python examples/ddp_train.py --devices 2          # on a SLURM cluster

The script is the same in every case: ``fabric.launch(train, args)`` starts the other ranks only when no
launcher did, and runs ``train`` in each (a spawned rank runs only that function, so the training lives in
one). Rank 0 prints the loss (averaged over ranks) and checks the replicas stayed identical.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--strategy", default="ddp")
    args = parser.parse_args()
    fabric = Fabric(accelerator="cpu", strategy=args.strategy, devices=args.devices)
    fabric.launch(train, args)


def train(fabric: Fabric, args: argparse.Namespace) -> None:
    fabric.seed_everything(7)

    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(4096, 20, generator=generator)
    targets = (inputs[:, :10].sum(dim=1) > inputs[:, 10:].sum(dim=1)).long()
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(inputs, targets), batch_size=64, shuffle=True))

    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-3))

    start = time.perf_counter()
    for epoch in range(args.epochs):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
        mean_loss = fabric.all_reduce(loss.detach(), reduce_op="mean")
        fabric.print(f"epoch {epoch}: loss {mean_loss.item():.4f}")

    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    replicas = fabric.all_gather(flat)
    identical = all(torch.equal(replicas[0], replica) for replica in replicas)
    samples = len(loader) * 64 * fabric.world_size * args.epochs
    fabric.print(
        f"{fabric.world_size} ranks, replicas identical: {identical}, "
        f"{samples / (time.perf_counter() - start):,.0f} samples/s"
    )


if __name__ == "__main__":
    main()
