"""A program written for Lightning Fabric (its imports, ``L.Fabric``, a CSV log with a ``step`` metric, a save of the
model and the set-up loader), for the drop-in tests: ``python lightning_program.py DEVICES OUT_DIR``."""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.loggers import CSVLogger
from lightning.fabric.plugins import BitsandbytesPrecision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities import ThroughputMonitor
from lightning.fabric.utilities.load import _lazy_load as lazy_load

devices, out = int(sys.argv[1]), Path(sys.argv[2])
fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=DDPStrategy() if devices > 1 else "auto",
                  loggers=CSVLogger(out))  # fmt: skip
fabric.launch()
L.seed_everything(0)
monitor = ThroughputMonitor(fabric, window_size=2)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = fabric.setup(model, optimizer)
loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(torch.randn(16, 4), batch_size=4))
losses = []
for step, batch in enumerate(loader):
    loss = model(batch).pow(2).mean()
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(fabric.all_reduce(loss.detach()).item())
    fabric.log_dict({"loss": losses[-1], "step": step}, step=step)
fabric.save(out / "state.ckpt", {"model": model, "optimizer": optimizer, "train_dataloader": loader, "iter_num": step})
weights = lazy_load(out / "state.ckpt", weights_only=False)["model"]
report = {
    "fabric_class": f"{type(fabric).__module__}.{type(fabric).__name__}",
    "quantized": isinstance(fabric.strategy.precision, BitsandbytesPrecision),
    "world_size": fabric.world_size,
    "losses": losses,
    "saved_weight": weights["weight"].tolist(),
}
(out / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))
