"""One replica group of a fault-tolerant run under the Trainer (strategy="fault_tolerant_ddp", or STRATEGY): a small
regression trained from a DataLoader with a worker process, until the batch count reaches the number in STOP_FILE; one
JSON line per batch and rank to REPORT_DIR, and checkpoints (for SIGTERM) in REPORT_DIR/ckpt-groupG.

Group and lighthouse come from the launcher's variables, as in tests/scripts/ft_replica_group.py.

    python ft_trainer_group.py REPORT_DIR STOP_FILE [STRATEGY] [--save-interval INTERVAL] [--autoresume] [--hold-at N]
                               [--min-groups N]

DDP groups are initialised apart (step 0 syncs them); FSDP shard groups alike, as they must be. ``--save-interval``
saves every INTERVAL (default: only when preempted), ``--autoresume`` resumes from the group's latest checkpoint, and
``--hold-at`` stops the process at the end of batch N, reported, until it is killed (every group lost at one point);
``--min-groups`` is the strategy's ``min_replica_groups``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from fabric.strategies import STRATEGY_REGISTRY
from fabric.trainer import Callback, Trainer
from fabric.trainer.core.state import State

SAMPLES, BATCH = 4096, 8
#: What a test needs to recompute the DistributedSampler's order of this group's share.
SAMPLER_FIELDS = ("num_replicas", "rank", "seed", "epoch", "shuffle")


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)

    def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:
        return self.linear(batch[0])

    def loss(self, outputs: torch.Tensor, batch: list[torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(outputs, batch[1])


class Report(Callback):
    """A line per batch (the clock, the run's committed steps, the weights), and the stop from STOP_FILE."""

    def __init__(self, out: Path, stop_file: Path, group: int, hold_at: int | None) -> None:
        self.out, self.stop_file, self.group, self.hold_at = out, stop_file, group, hold_at

    def batch_end(self, state: State, logger: Any) -> None:
        strategy = state.fabric.strategy  # type: ignore[union-attr]
        record = {
            "group": self.group,
            "rank": state.fabric.global_rank,  # type: ignore[union-attr]
            "pid": os.getpid(),
            "batch": int(state.timestamp.batch),
            "epoch": int(state.timestamp.epoch),
            "committed_steps": strategy.committed_steps,
            "participants": strategy.replica_groups.participants,
            "joined_at": strategy.replica_groups.joined_at,
            "batch_in_epoch": int(state.timestamp.batch_in_epoch),
            "indices": state.batch[2].tolist(),  # which samples this batch held
            "sampler": {name: getattr(state.dataloader.sampler, name) for name in SAMPLER_FIELDS},  # type: ignore[union-attr]
            "weights": [value for p in state.model.parameters() for value in _whole(p).reshape(-1).tolist()],
        }
        with self.out.open("a") as out:
            out.write(json.dumps(record) + "\n")
        while record["batch"] == self.hold_at:  # until the test kills the process
            time.sleep(1)
        text = self.stop_file.read_text().strip() if self.stop_file.exists() else ""
        if text and int(state.timestamp.batch) >= int(text):
            state.stop_training()


def _whole(parameter: torch.Tensor) -> torch.Tensor:
    return parameter.detach().full_tensor() if isinstance(parameter, DTensor) else parameter.detach()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("report_dir", type=Path)
    parser.add_argument("stop_file", type=Path)
    parser.add_argument("strategy", nargs="?", default="fault_tolerant_ddp")
    parser.add_argument("--save-interval", default="1000ep")  # by default saves only when preempted (SIGTERM)
    parser.add_argument("--autoresume", action="store_true")
    parser.add_argument("--hold-at", type=int)
    parser.add_argument("--min-groups", type=int, default=1)
    args = parser.parse_args()
    report_dir, strategy = args.report_dir, args.strategy
    # Unset in the process that starts every group (python SCRIPT without a group index), which leaves at Trainer(...)
    group = int(os.environ.get("FABRIC_FT_REPLICA_GROUP", "-1"))
    torch.manual_seed(7 if strategy == "fault_tolerant_fsdp" else group + 7)
    inputs = torch.randn(SAMPLES, 8, generator=torch.Generator().manual_seed(0))
    dataset = TensorDataset(inputs, inputs.sum(dim=1, keepdim=True) * 0.5, torch.arange(SAMPLES))
    report = Report(report_dir / f"group{group}-pid{os.getpid()}.jsonl", args.stop_file, group, args.hold_at)
    model = Regression()
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=1),
        max_duration="20ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        strategy=STRATEGY_REGISTRY.create(strategy, min_replica_groups=args.min_groups),
        accelerator="cpu",
        devices=1,
        callbacks=[report],
        save_folder=str(report_dir / "ckpt-group{replica_group}"),  # each group's own folder
        save_interval=args.save_interval,
        run_name=f"group{group}",
        autoresume=args.autoresume,
        progress_bar=False,
        seed=17,
    )
    trainer.fit()
    print(f"replica group {group} done at batch {int(trainer.state.timestamp.batch)}", flush=True)


if __name__ == "__main__":
    main()
