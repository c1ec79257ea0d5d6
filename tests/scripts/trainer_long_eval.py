"""A Trainer whose evaluation is long: ``trainer_long_eval.py FOLDER [KEY=VALUE ...]`` (``Trainer`` arguments).

It evaluates after its first batch over 40 samples that take 0.5 s each; the first writes FOLDER/evaluating and
every one appends a line to FOLDER/evaluated-rankR, so a test knows when to preempt and how far evaluation got.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from fabric.trainer.trainer import Trainer

folder = Path(sys.argv[1])
options = dict(argument.split("=", 1) for argument in sys.argv[2:])


class SlowSamples(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int):
        with open(folder / f"evaluated-rank{os.environ.get('RANK', '0')}", "a") as log:
            log.write(f"{index}\n")
        (folder / "evaluating").touch()
        time.sleep(0.5)
        return torch.ones(4), torch.ones(1)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def forward(self, batch):
        return self.net(batch[0])

    def loss(self, outputs, batch):
        return F.mse_loss(outputs, batch[1])


folder.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
model = Model()
trainer = Trainer(
    model=model,
    train_dataloader=DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=4),
    eval_dataloader=DataLoader(SlowSamples(), batch_size=1),
    eval_interval="1ba",
    max_duration="4ba",
    optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
    save_folder=str(folder / "ckpt"),
    save_interval="1000ba",
    run_name="long-eval",
    autoresume=True,
    progress_bar=False,
    accelerator="cpu",
    **options,
)
print(f"starts at batch {int(trainer.state.timestamp.batch)}", flush=True)
trainer.fit()
