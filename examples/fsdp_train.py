"""Fully sharded training (FSDP2) on 2 CPU processes, with a sharded checkpoint and a resume:

    python examples/fsdp_train.py                                                          # starts rank 1 itself
    fabric run model --accelerator=cpu --devices=2 --strategy=fsdp examples/fsdp_train.py  # the CLI starts both

Each rank holds half of every layer's parameters, gradients and Adam state. The model is built on
the meta device (no memory until ``setup`` materialises this rank's shards), trained, saved as a
sharded checkpoint directory, and reloaded into a fresh model. Turn the directory into one file with
``fabric consolidate checkpoints/fsdp checkpoints/fsdp.pt``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric
from fabric.strategies.fsdp import FSDPStrategy


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(20, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps to train")
    parser.add_argument("--checkpoint", default="checkpoints/fsdp", help="sharded checkpoint directory")
    args = parser.parse_args()

    # Under `fabric run model` the CLI's --strategy/--devices win; a plain run gets these.
    fabric = Fabric(accelerator="cpu", strategy=FSDPStrategy(shard_modules={nn.Linear}), devices=2)
    fabric.launch()
    fabric.seed_everything(7)

    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(4096, 20, generator=generator)
    targets = (inputs[:, :10].sum(dim=1) > inputs[:, 10:].sum(dim=1)).long()
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(inputs, targets), batch_size=64, shuffle=True))

    with fabric.init_module(empty_init=True):  # on the meta device: no parameter memory yet
        model = make_model()
    model = fabric.setup(model)  # shard, then materialise this rank's shards with reset_parameters()
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-3))
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    fabric.print(f"{fabric.world_size} ranks, rank 0 holds {local:,} of {total:,} parameters")

    step, first_loss = 0, None
    while step < args.steps:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            step += 1
            mean_loss = fabric.all_reduce(loss.detach()).item()
            first_loss = mean_loss if first_loss is None else first_loss
            if step % 50 == 0 or step == args.steps:
                fabric.print(f"step {step}: loss {mean_loss:.4f}")
            if step == args.steps:
                break

    fabric.save(args.checkpoint, {"model": model, "optimizer": optimizer, "step": step})
    with fabric.init_module(empty_init=True):
        resumed = make_model()
    resumed = fabric.setup(resumed)
    resumed_optimizer = fabric.setup_optimizers(torch.optim.Adam(resumed.parameters(), lr=1e-3))
    state = {"model": resumed, "optimizer": resumed_optimizer, "step": 0}
    fabric.load(args.checkpoint, state)
    pairs = zip(model.parameters(), resumed.parameters(), strict=True)
    same = all(torch.equal(a.to_local(), b.to_local()) for a, b in pairs)
    identical = bool(fabric.all_reduce(torch.tensor(float(same)), reduce_op="min").item())
    summary = f"loss {first_loss:.4f} -> {mean_loss:.4f}; resumed at step {state['step']}"
    fabric.print(f"{summary}, weights identical: {identical}")


if __name__ == "__main__":
    main()
