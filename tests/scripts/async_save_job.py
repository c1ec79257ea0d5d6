"""Background saves in a real job: ``python async_save_job.py SCENARIO OUT_DIR [DEVICES]``.

- ``seen``: every rank saves step 1, then step 2 in the background while rank 0's write waits for a file that
  rank 1 creates once it has checked that its own future is not complete yet; then every rank waits for its future
  and loads. Each rank writes ``OUT_DIR/rank{R}.json``: whether its future was done before rank 0 could write, and
  the step its load read.
- ``last_fails``: the script's last save is in the background and rank 0's write fails (a full disk); the script
  then ends normally. The process must still exit non-zero.
"""

import errno
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from fabric import Fabric
from fabric.plugins.io import TorchCheckpointIO
from fabric.plugins.io.checkpoint_io import PathType, StorageOptions

scenario, out_dir = sys.argv[1], Path(sys.argv[2])
devices = int(sys.argv[3]) if len(sys.argv) > 3 else 2
gate = out_dir / "rank1-checked"


class GatedIO(TorchCheckpointIO):
    """Writes step 2 only once ``gate`` exists (``seen``); fails like a full disk (``last_fails``)."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: PathType, storage_options: StorageOptions = None
    ) -> None:
        if scenario == "last_fails":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        if checkpoint["step"] == 2:
            deadline = time.monotonic() + 120
            while not gate.exists() and time.monotonic() < deadline:  # a handshake with rank 1, not a timing
                time.sleep(0.01)
        super().save_checkpoint(checkpoint, path, storage_options)


fabric = Fabric(accelerator="cpu", strategy="ddp", devices=devices, plugins=[GatedIO()])
fabric.launch()
model = fabric.setup(torch.nn.Linear(2, 2))
path = out_dir / "last.ckpt"
if scenario == "last_fails":
    fabric.save(path, {"model": model, "step": 1}, async_save=True)
    print(f"rank {fabric.global_rank}: script done", flush=True)
    sys.exit(0)

fabric.save(path, {"model": model, "step": 1})
written = fabric.save(path, {"model": model, "step": 2}, async_save=True)
done_before_the_write = written.done()
if fabric.global_rank == 1:
    gate.touch()
written.result()
state = {"model": model, "step": 0}
fabric.load(path, state)
(out_dir / f"rank{fabric.global_rank}.json").write_text(
    json.dumps({"done_before_the_write": done_before_the_write, "step": state["step"]})
)
