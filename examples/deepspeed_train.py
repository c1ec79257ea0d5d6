"""DeepSpeed ZeRO on 2 CPU processes (gloo), started either way:

    python examples/deepspeed_train.py                                               # Fabric starts rank 1
    fabric run model --accelerator=cpu --devices=2 --strategy=deepspeed_stage_2 examples/deepspeed_train.py

``--stage 3`` builds the model already partitioned (``fabric.init_module()`` -> ``deepspeed.zero.Init``).
Rank 0 prints the loss (averaged over ranks); at the end the job saves a sharded checkpoint, loads it back
and, on rank 0, consolidates it into one file of full weights. Needs ``pip install -e ".[deepspeed]"`` (from the
checkout).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric
from fabric.strategies.deepspeed import convert_zero_checkpoint_to_fp32


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/deepspeed"))
    args = parser.parse_args()

    fabric = Fabric(accelerator="cpu", strategy=f"deepspeed_stage_{args.stage}", devices=2)
    fabric.launch()
    fabric.seed_everything(7)

    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(2048, 20, generator=generator)
    targets = (inputs[:, :10].sum(dim=1) > inputs[:, 10:].sum(dim=1)).long()
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(inputs, targets), batch_size=64, shuffle=True))

    with fabric.init_module():
        model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-3))

    step = 0
    for epoch in range(args.epochs):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            step += 1
        fabric.print(f"epoch {epoch}: loss {fabric.all_reduce(loss.detach()).item():.4f}")

    checkpoint = args.out / "checkpoint"
    fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "step": step})
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(checkpoint, state)
    if fabric.is_global_zero:
        convert_zero_checkpoint_to_fp32(checkpoint, args.out / "consolidated.pt")
    fabric.barrier()
    fabric.print(
        f"{fabric.world_size} ranks, ZeRO stage {args.stage}: checkpoint of step {state['step']} reloaded, "
        f"consolidated into {args.out / 'consolidated.pt'}"
    )


if __name__ == "__main__":
    main()
