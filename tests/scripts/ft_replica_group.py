"""One replica group of a fault-tolerant run (strategy="fault_tolerant_ddp", or with ``--strategy`` FSDP2 shard groups):
trains a small regression until the run's committed step reaches the number in STOP_FILE, writing one JSON line per
step and rank (with the whole weights and the wall time) to REPORT_DIR, and ``ready-group...json`` there (the wall time)
once set up, before its first step.

Group and lighthouse come from the launcher's variables (FABRIC_FT_REPLICA_GROUP, FABRIC_FT_REPLICA_GROUPS,
TORCHFT_LIGHTHOUSE). Each step's batch depends on the step and on the rank's data share, so a reference can recompute
what the run should have trained.

    python ft_replica_group.py REPORT_DIR STOP_FILE [--devices N] [--strategy S] [--seed N] [--min-groups N]
                               [--clip MAX_NORM] [--load CHECKPOINT] [--save CHECKPOINT]
                               [--width W] [--accumulate K] [--expert]

``--load`` loads a checkpoint before the first step and writes ``REPORT_DIR/loaded-groupG.json`` (the committed step
count right after); ``--save`` saves one at the stop. Groups are initialised apart (step 0 syncs DDP groups), or
alike from ``--seed``; ``--min-groups`` is the strategy's ``min_replica_groups``; ``--clip`` clips the gradients' norm
(``fabric.clip_gradients``) before each step. ``--width`` puts a hidden layer of W x W between the two (W=520: over a
MiB, so that the gradients go out in two buckets; the weights are then reported at the stop step only);
``--accumulate`` splits each step's batch into K microbatches, all but the last under ``fabric.no_backward_sync``.
``--expert`` adds a layer that only some shares' batches use at a step (``uses_expert``), none at some steps (DDP
with ``find_unused_parameters=True``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fabric import Fabric
from fabric.strategies import STRATEGY_REGISTRY


def batch(step: int, share: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + share)
    inputs = torch.randn(16, 8, generator=generator)
    return inputs, inputs.sum(dim=1, keepdim=True) * 0.5


def build_model(width: int | None = None) -> nn.Module:
    if width is None:
        return nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1))
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))


def uses_expert(step: int, share: int) -> bool:
    """Whether share ``share``'s batch of step ``step`` goes through the expert layer (a branch only some take)."""
    return (step + share) % 3 == 0


class WithExpert(nn.Module):
    """``base``, plus ``expert``'s output where the batch takes that branch: a parameter that has a gradient in some
    groups' step and not in others' (as a mixture of experts' or conditional computation's)."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base, self.expert = base, nn.Linear(8, 1)

    def forward(self, inputs: torch.Tensor, use_expert: bool) -> torch.Tensor:
        outputs = self.base(inputs)
        return outputs + self.expert(inputs) if use_expert else outputs


def whole_weights(model: nn.Module) -> list[float]:
    """Every weight of the model, gathered from the group's shards where it is sharded (a collective then)."""
    tensors = [p.detach().full_tensor() if isinstance(p, DTensor) else p.detach() for p in model.parameters()]
    return [value for tensor in tensors for value in tensor.reshape(-1).tolist()]


def stop_step(stop_file: Path) -> int | None:
    text = stop_file.read_text().strip() if stop_file.exists() else ""
    return int(text) if text else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("report_dir", type=Path)
    parser.add_argument("stop_file", type=Path)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", default="fault_tolerant_ddp")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--min-groups", type=int, default=1)
    parser.add_argument("--clip", type=float)
    parser.add_argument("--load", type=Path)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--width", type=int)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--expert", action="store_true")
    args = parser.parse_args()

    options = {"find_unused_parameters": True} if args.expert and "ddp" in args.strategy else {}
    strategy = STRATEGY_REGISTRY.create(args.strategy, min_replica_groups=args.min_groups, **options)
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    torch.manual_seed(int(os.environ["FABRIC_FT_REPLICA_GROUP"]) + 7 if args.seed is None else args.seed)
    model = WithExpert(build_model(args.width)) if args.expert else build_model(args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    strategy = fabric.strategy
    _, share = strategy.data_parallel_shard
    group = strategy.fault_tolerance.replica_group
    report = args.report_dir / f"group{group}-rank{fabric.global_rank}-pid{os.getpid()}.jsonl"
    if args.load is not None:
        fabric.load(args.load, {"model": model, "optimizer": optimizer})
        if fabric.global_rank == 0:
            loaded = {"committed_steps": strategy.committed_steps}
            (args.report_dir / f"loaded-group{group}.json").write_text(json.dumps(loaded))
    ready = {"committed_steps": strategy.committed_steps, "time": time.time()}  # before its first quorum request
    ready_file = args.report_dir / f"ready-group{group}-rank{fabric.global_rank}-pid{os.getpid()}.json"
    ready_file.write_text(json.dumps(ready))
    with report.open("a") as out:
        while True:
            step = strategy.committed_steps
            stop = stop_step(args.stop_file)
            if stop is not None and step >= stop:
                break
            optimizer.zero_grad()
            inputs, targets = batch(step, share)
            pieces = list(zip(inputs.chunk(args.accumulate), targets.chunk(args.accumulate), strict=True))
            for index, (piece, target) in enumerate(pieces):
                with fabric.no_backward_sync(model, enabled=index < len(pieces) - 1):
                    outputs = model(piece, uses_expert(step, share)) if args.expert else model(piece)
                    fabric.backward(nn.functional.mse_loss(outputs, target) / len(pieces))
            if args.clip is not None:
                fabric.clip_gradients(model, optimizer, max_norm=args.clip)
            optimizer.step()
            record = {
                "group": group,
                "rank": fabric.global_rank,
                "pid": os.getpid(),
                "step": step,
                "committed_steps": strategy.committed_steps,
                "participants": strategy.replica_groups.participants,
                "joined_at": strategy.replica_groups.joined_at,
                "time": time.time(),
            }
            if args.width is None or record["committed_steps"] == stop:
                record["weights"] = whole_weights(model)
            out.write(json.dumps(record) + "\n")
            out.flush()
    if args.save is not None:
        fabric.save(args.save, {"model": model, "optimizer": optimizer})
    fabric.print(f"replica group {group} done at step {strategy.committed_steps}")


if __name__ == "__main__":
    main()
