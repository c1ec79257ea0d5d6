"""A 2-rank Trainer job for ``torchrun --max-restarts``: ``trainer_torchrun_restart.py OUT_DIR KILL_AT``.

Checkpoints every 2 batches with ``autoresume=True``. In torchrun's first attempt, rank 1 SIGKILLs itself
at the end of batch KILL_AT (0: never), so torchrun restarts both ranks, which resume from the latest
checkpoint. Each rank saves its final weights and the attempt number to OUT_DIR/final-rankR.pt.
"""

import os
import signal
import sys
from pathlib import Path

import torch
from sine_job import Net, sine_data
from torch.utils.data import DataLoader

from fabric.trainer.core.callback import Callback
from fabric.trainer.trainer import Trainer

out_dir, kill_at = Path(sys.argv[1]), int(sys.argv[2])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class DieOnce(Callback):
    def batch_end(self, state, logger):
        if attempt == 0 and int(state.timestamp.batch) == kill_at and os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)


torch.manual_seed(0)
model = Net()
data = sine_data()
trainer = Trainer(
    model=model,
    train_dataloader=DataLoader(data, batch_size=8, shuffle=True),  # 6 batches per epoch on 2 ranks
    max_duration="10ba",
    optimizers=torch.optim.Adam(model.parameters(), lr=0.01),
    callbacks=[DieOnce()],
    save_folder=str(out_dir / "ckpt"),
    save_interval="2ba",
    run_name="restart",
    autoresume=True,
    save_overwrite=True,
    progress_bar=False,
    seed=3,
    accelerator="cpu",
    strategy="ddp",
    devices=2,
)
resumed_at = int(trainer.state.timestamp.batch)
trainer.fit()
torch.save(
    {"params": [p.detach() for p in model.parameters()], "attempt": attempt, "resumed_at": resumed_at},
    out_dir / f"final-rank{trainer.fabric.global_rank}.pt",
)
