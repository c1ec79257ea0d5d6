"""The Trainer on a sharded strategy: ``python trainer_sharded.py STRATEGY FOLDER DURATION OUT [KEY=VALUE ...]``.

Two CPU ranks train a small regressor, checkpointing every epoch into FOLDER (a path or URL) and
auto-resuming from it; rank 0 writes the full weights and the clock to OUT. ``KEY=VALUE`` pairs are
integer ``Trainer`` arguments (``devices=1 num_nodes=2`` under torchrun across two nodes; ``save_async=0|1`` is
passed as False or True).
``KILL_RANK_AT_SAVE=R:N`` in the environment kills rank R (SIGKILL) while it writes its part of save N
to an object store, after the data went out and before the file was closed.
"""

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from upload_kill import die_during_shard_upload

from fabric.trainer import Trainer

strategy, folder, duration, out = sys.argv[1:5]
options: dict[str, int | bool] = {
    key: int(value) for key, value in (argument.split("=", 1) for argument in sys.argv[5:])
}
if "save_async" in options:  # a flag: the Trainer takes True or False, not 0 or 1
    options["save_async"] = bool(options["save_async"])


if "KILL_RANK_AT_SAVE" in os.environ:
    die_during_shard_upload(*(int(part) for part in os.environ["KILL_RANK_AT_SAVE"].split(":")))


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, batch):
        return self.net(batch[0])

    def loss(self, outputs, batch):
        return F.mse_loss(outputs, batch[1])


torch.manual_seed(0)
model = Regressor()
x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
trainer = Trainer(
    model=model,
    train_dataloader=DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8),
    max_duration=duration,
    optimizers=torch.optim.Adam(model.parameters(), lr=1e-2),
    save_folder=folder,
    save_interval="1ep",
    run_name="sharded",
    autoresume=True,
    progress_bar=False,
    seed=0,
    accelerator="cpu",
    strategy=strategy,
    **{"devices": 2, **options},
)
started_at = int(trainer.state.timestamp.batch)
trainer.fit()
weights = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in trainer.state.model.parameters()]
if trainer.fabric.is_global_zero:
    torch.save(
        {
            "weights": [w.detach().clone() for w in weights],
            "started_at": started_at,
            "batch": int(trainer.state.timestamp.batch),
        },
        out,
    )
