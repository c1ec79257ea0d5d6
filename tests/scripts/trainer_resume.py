"""A long Trainer job that checkpoints and autoresumes:
``python trainer_resume.py FOLDER MAX_BATCHES [INTERVAL [KEY=VALUE ...]]``.

It prints ``resumed at batch N`` when it found a checkpoint, and ``training`` once its first batch is
done (the SIGTERM handler is active from then on). ``MAX_BATCHES=0`` only resumes. ``num_workers=N`` gives the
DataLoader worker processes; other ``KEY=VALUE`` pairs are ``Trainer`` arguments (``devices=2``).
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric.trainer.core.callback import Callback
from fabric.trainer.trainer import Trainer

folder, max_batches = sys.argv[1], int(sys.argv[2])
interval = sys.argv[3] if len(sys.argv) > 3 else "1ba"
options = dict(argument.split("=", 1) for argument in sys.argv[4:])
num_workers = int(options.pop("num_workers", 0))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(*(nn.Linear(512, 512) for _ in range(4)))

    def forward(self, batch):
        return self.net(batch[0])

    def loss(self, outputs, batch):
        return F.mse_loss(outputs, batch[1])


class AnnounceFirstBatch(Callback):
    def batch_end(self, state, logger):
        if int(state.timestamp.batch_in_epoch) == 1:
            print("training", flush=True)


torch.manual_seed(0)
model = Model()
data = TensorDataset(torch.randn(64, 512), torch.randn(64, 512))
trainer = Trainer(
    model=model,
    train_dataloader=DataLoader(data, batch_size=8, num_workers=num_workers, persistent_workers=num_workers > 0),
    max_duration=f"{max(max_batches, 1)}ba",
    optimizers=torch.optim.Adam(model.parameters(), lr=1e-4),
    callbacks=[AnnounceFirstBatch()],
    save_folder=folder + "/{run_name}",
    save_interval=interval,
    run_name="job",
    autoresume=True,
    save_overwrite=True,
    progress_bar=False,
    seed=0,
    accelerator="cpu",
    **options,
)
if int(trainer.state.timestamp.batch):
    print(f"resumed at batch {int(trainer.state.timestamp.batch)}", flush=True)
if max_batches:
    trainer.fit()
