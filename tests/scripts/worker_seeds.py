"""Dataloader worker seeds on 2 DDP ranks: ``python worker_seeds.py OUT_DIR``.

Each rank iterates a loader with 2 workers whose samples report the worker id and one draw from torch,
``random`` and NumPy: after ``seed_everything(7, workers=False)``, ``seed_everything(7)`` (workers seeded
by default) and ``seed_everything(7, workers=True)``.
Each rank writes ``{mode: {worker: [draws of its first sample]}}`` to ``OUT_DIR/rank{R}.json``.
"""

import json
import random
import sys
from pathlib import Path

import numpy
import torch
from torch.utils.data import DataLoader, Dataset

from fabric import Fabric


class Draws(Dataset[list[float]]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> list[float]:
        info = torch.utils.data.get_worker_info()
        assert info is not None
        return [float(info.id), torch.rand(()).item(), random.random(), float(numpy.random.rand())]


def first_draws(fabric: Fabric) -> dict[int, list[float]]:
    loader = fabric.setup_dataloaders(DataLoader(Draws(), batch_size=None, num_workers=2))
    draws: dict[int, list[float]] = {}
    for sample in loader:
        draws.setdefault(int(sample[0]), sample[1:])
    return draws


fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
fabric.launch()
report = {}
for mode, workers in (("plain", {"workers": False}), ("workers", {}), ("workers_again", {"workers": True})):
    fabric.seed_everything(7, **workers)  # the default seeds the workers, as workers=True does
    report[mode] = first_draws(fabric)
out_dir = Path(sys.argv[1])
out_dir.mkdir(parents=True, exist_ok=True)
(out_dir / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))
