"""The Trainer on DDP: ``python trainer_ddp.py OUT_DIR DEVICES [auto_oom|lbfgs]``; each rank saves what it computed.

With ``devices=2`` constructing the Trainer starts rank 1 (strategy "ddp" re-runs this script). The global
batch is 16 whatever the number of ranks, so every run should reach the same weights. ``auto_oom`` makes
rank 1 alone run out of memory on training batches above 4 samples (both ranks must agree to halve) and on eval
forwards above 2 samples (rank 0's forwards are kept; each rank counts the samples its kept forwards saw).
``lbfgs`` trains with LBFGS and a strong-Wolfe line search, whose decisions follow the closure's loss, and logs to
the console only (rank 0 alone has a logger).
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric.trainer.core.callback import Callback
from fabric.trainer.evaluation import Evaluator
from fabric.trainer.loggers.in_memory import InMemoryLogger
from fabric.trainer.trainer import Trainer

out_dir, devices = Path(sys.argv[1]), int(sys.argv[2])
mode = sys.argv[3] if len(sys.argv) > 3 else ""
inject_oom = mode == "auto_oom"


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.rank = 0

    def forward(self, batch):
        if inject_oom and self.rank == 1 and len(batch[0]) > (4 if self.training else 2):
            raise torch.OutOfMemoryError("injected on rank 1")
        return self.net(batch[0])

    def loss(self, outputs, batch):
        return F.mse_loss(outputs, batch[1])

    def get_metrics(self, is_train=False):
        return {"mae": lambda outputs, batch: (outputs - batch[1]).abs().mean()}


class EvalForwardSamples(Callback):
    """Counts the samples of the eval forwards that EVAL_AFTER_FORWARD reports."""

    def __init__(self) -> None:
        self.samples = 0

    def eval_after_forward(self, state, logger):
        self.samples += len(state.batch[0])


torch.manual_seed(0)
model = Regressor()
counter = EvalForwardSamples()
memory = InMemoryLogger()
x = torch.randn(64, 6, generator=torch.Generator().manual_seed(1))
y = x.sum(dim=1, keepdim=True).sin()
data = TensorDataset(x, y)
trainer = Trainer(
    model=model,
    train_dataloader=DataLoader(data, batch_size=16 // devices),
    eval_dataloader=Evaluator(
        "eval", DataLoader(data, batch_size=8), device_eval_microbatch_size="auto" if inject_oom else None
    ),
    callbacks=counter,
    loggers=memory if mode != "lbfgs" else (),
    log_to_console=mode == "lbfgs",  # a rank-0-only destination: rank 1 logs nowhere, and must still reduce
    max_duration="3ep",
    optimizers=(
        torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, line_search_fn="strong_wolfe")
        if mode == "lbfgs"
        else torch.optim.SGD(model.parameters(), lr=0.1)
    ),
    device_train_microbatch_size="auto" if inject_oom else None,
    progress_bar=False,
    seed=0,
    accelerator="cpu",
    strategy="ddp" if devices > 1 else "auto",
    devices=devices,
)
model.rank = trainer.fabric.global_rank
trainer.fit()
state = trainer.state
out_dir.mkdir(parents=True, exist_ok=True)
torch.save(
    {
        "params": [p.detach() for p in model.parameters()],
        "samples": int(state.timestamp.sample),
        "batches": int(state.timestamp.batch),
        "mae": state.metrics["metrics/eval/mae"],
        "microbatch": state.device_train_microbatch_size,
        "world_size": trainer.fabric.world_size,
        "eval_forward_samples": counter.samples,
        "eval_microbatch": state.device_eval_microbatch_size,
        "logged_losses": [value for _, value in memory.data.get("loss/train/total", [])],
        "composer_state": [state.is_model_ddp, state.model.module is model, state.device.name],
    },
    out_dir / f"rank{trainer.fabric.global_rank}.pt",
)
