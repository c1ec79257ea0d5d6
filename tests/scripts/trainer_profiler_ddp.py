"""``python trainer_profiler_ddp.py TRACE_FOLDER DEVICES``: a Trainer with a Profiler; each rank writes its trace."""

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric.trainer.profiler import Profiler, cyclic_schedule
from fabric.trainer.trainer import Trainer

folder, devices = sys.argv[1], int(sys.argv[2])


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def forward(self, batch):
        return self.net(batch[0])

    def loss(self, outputs, batch):
        return F.mse_loss(outputs, batch[1])


torch.manual_seed(0)
model = Regressor()
x = torch.randn(32, 4)
trainer = Trainer(
    model=model,
    train_dataloader=DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4),
    max_duration="4ba",
    optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
    profiler=Profiler(cyclic_schedule(wait=1, warmup=1, active=2), torch_prof_folder=folder),
    run_name="profiled",
    progress_bar=False,
    seed=0,
    accelerator="cpu",
    strategy="ddp" if devices > 1 else "auto",
    devices=devices,
)
trainer.fit()
trainer.close()
