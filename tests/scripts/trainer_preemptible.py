"""A Trainer job for a scheduler's preemption: ``trainer_preemptible.py OUT_DIR WAIT_AT [NUM_WORKERS]``.

A default ``Trainer`` (it follows the launcher's world) trains 10 batches with ``autoresume=True`` into
OUT_DIR/ckpt. With WAIT_AT > 0, each rank stops at the end of batch WAIT_AT, writes OUT_DIR/waiting-rankR and
waits until it has itself received SIGTERM (the scheduler's preemption), so the stop lands at one known batch
whatever the delivery delay. Each rank then saves its final weights to OUT_DIR/final-rankR.pt. NUM_WORKERS
(default 0) DataLoader worker processes load the data: a scheduler's SIGTERM reaches them too.
"""

import signal
import sys
import threading
from pathlib import Path

import torch
from sine_job import Net, sine_data
from torch.utils.data import DataLoader

from fabric.trainer.core.callback import Callback
from fabric.trainer.trainer import Trainer

out_dir, wait_at = Path(sys.argv[1]), int(sys.argv[2])
num_workers = int(sys.argv[3]) if len(sys.argv) > 3 else 0


class WaitForSigterm(Callback):
    def batch_end(self, state, logger):
        if int(state.timestamp.batch) != wait_at:
            return
        received = threading.Event()
        trainer_handler = signal.getsignal(signal.SIGTERM)

        def note_then_pass_on(signum, frame):
            received.set()
            trainer_handler(signum, frame)

        signal.signal(signal.SIGTERM, note_then_pass_on)
        (out_dir / f"waiting-rank{trainer.fabric.global_rank}").touch()
        if not received.wait(timeout=120):
            sys.exit("no SIGTERM within 120 s")


torch.manual_seed(0)
model = Net()
data = sine_data()
trainer = Trainer(
    model=model,
    # 6 batches per epoch on 2 ranks
    train_dataloader=DataLoader(data, batch_size=8, shuffle=True, num_workers=num_workers),
    max_duration="10ba",
    optimizers=torch.optim.Adam(model.parameters(), lr=0.01),
    callbacks=[WaitForSigterm()],
    save_folder=str(out_dir / "ckpt"),
    run_name="preemptible",
    autoresume=True,
    progress_bar=False,
    seed=3,
    accelerator="cpu",
)
fabric = trainer.fabric
print(f"rank {fabric.global_rank}/{fabric.world_size} starts at batch {int(trainer.state.timestamp.batch)}")
trainer.fit()
torch.save([p.detach() for p in model.parameters()], out_dir / f"final-rank{trainer.fabric.global_rank}.pt")
