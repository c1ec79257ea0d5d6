"""The Trainer over a streaming-style dataset: ``trainer_streaming.py OUT_DIR DEVICES CRASH_AT RUN``.

DEVICES ranks (an in-script launch) train 3 epochs over the 64 samples of ``StreamingLikeDataset`` in batches of
4, checkpointing every batch into OUT_DIR/ckpt and auto-resuming from it. Every rank appends the ids it trained,
with their epoch, to OUT_DIR/ids-RUN-rankR.txt. With CRASH_AT > 0 every rank dies (exit 17) right after the
checkpoint of batch CRASH_AT, before fetching the next batch: nothing trained is lost, nothing is logged twice.
"""

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from streaming_double import StreamingLikeDataset, StreamingLikeLoader
from torch import nn

from fabric.trainer import Trainer
from fabric.trainer.callback import Callback

out_dir, devices, crash_at, run = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]


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
    train_dataloader=StreamingLikeLoader(StreamingLikeDataset(64), batch_size=4),
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
