"""Resume across runs on DDP: ``python trainer_ddp_resume.py OUT_DIR DEVICES MODE`` with MODE one of
``full`` (10 batches straight), ``first`` (stop after 4 batches, mid-epoch, and checkpoint) or ``resume``
(load OUT_DIR/first.pt and train to 10 batches). Each rank saves its weights and clock to OUT_DIR/MODE-rankR.pt.
"""

import sys
from pathlib import Path

import torch
from sine_job import Net, sine_data
from torch.utils.data import DataLoader

from fabric.trainer.core.callback import Callback
from fabric.trainer.trainer import Trainer

out_dir, devices, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]


class StopAfterFour(Callback):
    def batch_end(self, state, logger):
        if int(state.timestamp.batch) == 4:
            state.stop_training()


torch.manual_seed(0)
model = Net()
data = sine_data()
trainer = Trainer(
    model=model,
    train_dataloader=DataLoader(data, batch_size=8, shuffle=True),  # 96 / (8 x 2) = 6 batches per epoch
    max_duration="10ba",
    optimizers=torch.optim.Adam(model.parameters(), lr=0.01),
    callbacks=[StopAfterFour()] if mode == "first" else [],
    load_path=str(out_dir / "first.pt") if mode == "resume" else None,
    progress_bar=False,
    seed=3,
    accelerator="cpu",
    strategy="ddp" if devices > 1 else "auto",
    devices=devices,
)
resumed_at = int(trainer.state.timestamp.batch), int(trainer.state.timestamp.sample)
trainer.fit()
if mode == "first":
    trainer.save_checkpoint(str(out_dir / "first.pt"))
state = trainer.state
torch.save(
    {
        "params": [p.detach() for p in model.parameters()],
        "resumed_at": resumed_at,
        "batch": int(state.timestamp.batch),
        "sample": int(state.timestamp.sample),
    },
    out_dir / f"{mode}-{devices}-rank{trainer.fabric.global_rank}.pt",
)
