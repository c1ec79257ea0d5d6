"""``fabric.init_module(empty_init=True)`` under DDP on 2 ranks: ``python empty_init_guard.py OUT_DIR``.

A model built uninitialised and set up (wrapped in DDP) must refuse its forward until ``fabric.load``
filled it; afterwards it trains exactly like the model the checkpoint came from (same DDP step on both).
Each rank writes what it saw to ``OUT_DIR/rank{R}.json``.
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fabric import Fabric
from fabric.utilities.processes.exit import exit_process

out_dir = Path(sys.argv[1])
fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
fabric.launch()
x = torch.randn(8, 6, generator=torch.Generator().manual_seed(fabric.global_rank))
y = x.sum(dim=1, keepdim=True).sin()


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    fabric.backward(loss)
    optimizer.step()
    return loss.item()


torch.manual_seed(0)
source = make_model()
source, source_optimizer = fabric.setup(source, torch.optim.SGD(source.parameters(), lr=0.1))
fabric.save(out_dir / "source.pt", {"model": source})

with fabric.init_module(empty_init=True):
    model = make_model()
model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
report: dict[str, object] = {"world_size": fabric.world_size}
try:
    model(x)
    report["refused"] = "the forward ran"
except RuntimeError as error:
    report["refused"] = str(error)

fabric.load(out_dir / "source.pt", {"model": model})
report["loss"], report["source_loss"] = train_step(model, optimizer), train_step(source, source_optimizer)
report["params_equal_source"] = all(
    torch.equal(a, b) for a, b in zip(model.parameters(), source.parameters(), strict=True)
)
report["params"] = [p.detach().flatten().tolist() for p in model.parameters()]
(out_dir / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))
exit_process(0, run_registered_cleanups=True)
