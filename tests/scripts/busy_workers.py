"""Rank 1 fails while rank 0's DataLoader worker is busy: ``busy_workers.py OUT_DIR``, under any launcher that
starts 2 ranks (``devices=2`` in-script). The worker writes OUT_DIR/worker.pid, then works on one sample for 10
minutes; rank 1 exits 3 as soon as that file exists. Nothing of the job may outlive it."""

import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from fabric import Fabric

out_dir = Path(sys.argv[1])


class SlowSample(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        (out_dir / "worker.pid.tmp").write_text(str(os.getpid()))
        (out_dir / "worker.pid.tmp").rename(out_dir / "worker.pid")
        time.sleep(600)
        return torch.zeros(1)


fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
loader = fabric.setup_dataloaders(DataLoader(SlowSample(), batch_size=1, num_workers=1))
if fabric.global_rank == 1:
    while not (out_dir / "worker.pid").exists():
        time.sleep(0.05)
    sys.exit(3)
for _ in loader:
    pass
