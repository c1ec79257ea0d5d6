"""Two-stage training on two CPU ranks: ``python trainer_two_stage.py ddp|fsdp OUT``.

Stage 1: SGD for 2 epochs; stage 2: ``fit(train_dataloader=other, duration="1ep", reset_time=True,
optimizers=Adam(...))``. ``ddp`` runs ``strategy="ddp"``, ``fsdp`` Composer's ``parallelism_config={"fsdp":
...}``, both with ``dist_timeout``. Rank 0 writes the initial and final full weights, the clock after each stage
and the strategy's timeout to OUT. Each rank's batch is 4 samples, so a global batch is 8.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric.trainer import Trainer

strategy, out = sys.argv[1:3]


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, batch):
        return self.net(batch[0])

    def loss(self, outputs, batch):
        return F.mse_loss(outputs.squeeze(-1), batch[1])


def data(samples, seed):
    x = torch.randn(samples, 4, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, x.sum(1).sin())


model = Regressor()
initial = {key: value.clone() for key, value in model.net.state_dict().items()}
choice = (
    {"strategy": "ddp"}
    if strategy == "ddp"
    else {"parallelism_config": {"fsdp": {"sharding_strategy": "FULL_SHARD", "state_dict_type": "sharded"}}}
)
trainer = Trainer(
    model=model,
    train_dataloader=DataLoader(data(32, 0), batch_size=4),
    optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
    progress_bar=False,
    seed=0,
    accelerator="cpu",
    devices=2,
    dist_timeout=123.0,
    **choice,
)
stamps = []
trainer.fit(duration="2ep")
stamps.append(trainer.state.timestamp)
# Under FSDP model.parameters() are the shards now; the new optimizer is set up on them.
trainer.fit(
    train_dataloader=DataLoader(data(16, 1), batch_size=4),
    duration="1ep",
    reset_time=True,
    optimizers=torch.optim.Adam(model.parameters(), lr=0.01),
)
stamps.append(trainer.state.timestamp)
weights = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in trainer.state.model.parameters()]
if trainer.fabric.is_global_zero:
    torch.save(
        {
            "initial": initial,
            "weights": [w.detach().clone() for w in weights],
            "stamps": [(int(s.epoch), int(s.batch), int(s.sample)) for s in stamps],
            "timeout": trainer.fabric.strategy.timeout.total_seconds(),
            "strategy": type(trainer.fabric.strategy).__name__,
            "world_size": trainer.fabric.world_size,
        },
        out,
    )
