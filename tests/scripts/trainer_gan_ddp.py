"""Two optimizers, one loss each (a GAN's shape), on DDP: ``python trainer_gan_ddp.py DEVICES OUT``.

The global batch is 16 whatever the number of ranks; rank 0 saves the final parameters to OUT.
"""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric.trainer import Trainer

devices, out = int(sys.argv[1]), sys.argv[2]


class TwoPlayers(nn.Module):
    """``first`` is trained on its own loss only, ``second`` on its own, though the second sees the first's output."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 1)
        self.second = nn.Linear(8, 1)

    def forward(self, batch):
        first = self.first(batch[0])
        return first, self.second(batch[0] + first)

    def loss(self, outputs, batch):
        first, second = outputs
        return first.pow(2).mean() - second.mean(), (second - batch[1]).pow(2).mean()


torch.manual_seed(0)
model = TwoPlayers()
x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
trainer = Trainer(
    model=model,
    train_dataloader=DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16 // devices),
    max_duration="6ba",
    optimizers=[torch.optim.SGD(model.first.parameters(), lr=0.1), torch.optim.SGD(model.second.parameters(), lr=0.1)],
    progress_bar=False,
    seed=0,
    accelerator="cpu",
    devices=devices,
    strategy="ddp" if devices > 1 else "auto",
)
trainer.fit()
params = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = trainer.fabric.all_gather(params)
if trainer.fabric.is_global_zero:
    torch.save({"params": params, "ranks_identical": all(torch.equal(gathered[0], g) for g in gathered)}, out)
