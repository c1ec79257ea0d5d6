"""Fabric embedded in a hand-written training loop: the demo the README runs.

A small MLP learns to classify points of two interleaved spirals (synthetic data made here, nothing
downloaded). Every few epochs it prints the loss, the accuracy and the throughput, so you can watch
the loss fall. Try ``--precision bf16-mixed`` or ``--precision 64-true``.

    python examples/train_fabric.py --epochs 20 --precision bf16-mixed
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric


def make_spirals(num_points: int, generator: torch.Generator) -> TensorDataset:
    """Two spirals winding around each other, with a little noise: not linearly separable."""
    label = torch.randint(0, 2, (num_points,), generator=generator)
    radius = torch.rand(num_points, generator=generator) * 3 * math.pi
    angle = radius + label * math.pi
    points = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1) / (3 * math.pi)
    points += 0.02 * torch.randn(num_points, 2, generator=generator)
    return TensorDataset(points, label)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    fabric = Fabric(accelerator=args.accelerator, precision=args.precision)
    fabric.seed_everything(42)
    fabric.print(f"Running on {fabric.device} with precision {fabric.precision.name}")

    dataset = make_spirals(8192, torch.Generator().manual_seed(0))
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=args.batch_size, shuffle=True))

    with fabric.init_module():
        model = nn.Sequential(nn.Linear(2, 128), nn.SiLU(), nn.Linear(128, 128), nn.SiLU(), nn.Linear(128, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    fabric.print(f"{'epoch':>5} {'loss':>8} {'accuracy':>9} {'samples/s':>10}")
    for epoch in range(1, args.epochs + 1):
        start, seen, total_loss, correct = time.perf_counter(), 0, 0.0, 0
        for points, labels in loader:
            logits = model(points)
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            fabric.backward(loss)
            optimizer.step()
            seen += labels.numel()
            total_loss += loss.item() * labels.numel()
            correct += int((logits.argmax(dim=1) == labels).sum())
        scheduler.step()
        if epoch == 1 or epoch % 5 == 0 or epoch == args.epochs:
            throughput = seen / (time.perf_counter() - start)
            fabric.print(f"{epoch:>5} {total_loss / seen:>8.4f} {correct / seen:>9.1%} {throughput:>10,.0f}")

    fabric.save("runs/demo/spiral.pt", {"model": model, "optimizer": optimizer, "epoch": args.epochs})
    fabric.print("Saved runs/demo/spiral.pt")


if __name__ == "__main__":
    main()
