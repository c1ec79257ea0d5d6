"""The Trainer over resumable data: ``trainer_streaming.py OUT_DIR DEVICES CRASH_AT RUN [map BATCH [SAMPLES]]``.

DEVICES ranks (an in-script launch) train 3 epochs over the 64 samples of ``StreamingLikeDataset`` in batches of
4, or with ``map`` over a map-style dataset of SAMPLES (default 64) in a shuffling DataLoader with batches of
BATCH; they checkpoint every batch into OUT_DIR/ckpt and auto-resume from it. Every rank appends the ids it
trained, with their epoch, to OUT_DIR/ids-RUN-rankR.txt. With CRASH_AT > 0 every rank dies (exit 17) right after
the checkpoint of batch CRASH_AT, before fetching the next batch: nothing trained is lost, nothing logged twice.
"""

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from streaming_double import StreamingLikeDataset, StreamingLikeLoader
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fabric.trainer import Trainer
from fabric.trainer.callback import Callback

out_dir, devices, crash_at, run = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
map_style = len(sys.argv) > 5 and sys.argv[5] == "map"


class Samples(Dataset):
    """A map-style dataset of samples ``{"id": i, ...}``."""

    def __init__(self, count):
        self.count = count

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        return {"id": index, "x": torch.full((4,), float(index)), "y": torch.tensor([float(index % 3)])}


if map_style:
    samples = int(sys.argv[7]) if len(sys.argv) > 7 else 64
    train_dataloader = DataLoader(Samples(samples), batch_size=int(sys.argv[6]), shuffle=True)
else:
    train_dataloader = StreamingLikeLoader(StreamingLikeDataset(64), batch_size=4)


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def forward(self, batch):
        return self.net(batch["x"])

    def loss(self, outputs, batch):
        return F.mse_loss(outputs, batch["y"])


class LogIdsThenCrash(Callback):
    def batch_end(self, state, logger):
        rank = state.fabric.global_rank
        with open(out_dir / f"ids-{run}-rank{rank}.txt", "a") as log:
            for sample_id in state.batch["id"].tolist():
                log.write(f"{int(state.timestamp.epoch)} {sample_id}\n")

    def before_dataloader(self, state, logger):
        if crash_at and int(state.timestamp.batch) == crash_at:
            os._exit(17)


torch.manual_seed(0)
model = Regressor()
trainer = Trainer(
    model=model,
    train_dataloader=train_dataloader,
    max_duration="3ep",
    optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
    callbacks=[LogIdsThenCrash()],
    save_folder=str(out_dir / "ckpt"),
    save_interval="1ba",
    save_overwrite=True,
    save_num_checkpoints_to_keep=1,
    run_name="streaming",
    autoresume=True,
    progress_bar=False,
    seed=0,
    accelerator="cpu",
    devices=devices,
)
trainer.fit()
