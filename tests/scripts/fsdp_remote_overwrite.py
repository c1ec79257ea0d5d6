"""A sharded save over the one already at a URL: ``python fsdp_remote_overwrite.py URL OUT [kill]``.

Two FSDP ranks save ``{"model", "step": 1}`` to URL, change the weights, and save ``step: 2`` over it. Rank 0 writes
each step's full weights to ``OUT/step{N}.pt`` before saving it. With ``kill``, rank 1 is SIGKILLed while it uploads
its shard of the second save, after the data went out and before the file was closed.
"""

import os
import signal
import sys
from pathlib import Path

import torch

from fabric import Fabric

url, out = sys.argv[1], Path(sys.argv[2])
kill = sys.argv[3:] == ["kill"]


def die_in_second_shard_upload() -> None:
    import fsspec.spec

    opened = fsspec.spec.AbstractBufferedFile.__init__
    shard_writes = []

    def watched(file, *args, **kwargs):
        opened(file, *args, **kwargs)
        if "w" in file.mode and file.path.endswith(".distcp"):
            shard_writes.append(file.path)
            if len(shard_writes) == 2:
                original_write = file.write

                def write_then_die(data):
                    original_write(data)
                    os.kill(os.getpid(), signal.SIGKILL)

                file.write = write_then_die

    fsspec.spec.AbstractBufferedFile.__init__ = watched


fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=2)
fabric.launch()
if kill and fabric.global_rank == 1:
    die_in_second_shard_upload()
torch.manual_seed(0)
model = fabric.setup(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)))
for step in (1, 2):
    weights = {name: tensor.full_tensor() for name, tensor in model.state_dict().items()}
    if fabric.global_rank == 0:
        torch.save(weights, out / f"step{step}.pt")
    fabric.save(url, {"model": model, "step": step})
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
