"""The restart path, for comparison with fault tolerance (tests/strategies/fault_tolerant/test_fault_tolerant.py): a
3-process Fabric DDP job under ``torchrun --max-restarts=1`` that saves a checkpoint every EVERY steps; on its first
attempt rank 2 SIGKILLs itself once step KILL_AT is done, torchrun restarts every rank, and the job resumes from its
latest checkpoint and trains to STEPS. Each rank writes ``OUT/attempt-N-rankR.json``: the step the attempt started at
and its process id.

    torchrun --nproc-per-node=3 --max-restarts=1 ddp_restart_job.py OUT STEPS EVERY KILL_AT
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

from fabric import Fabric

out, steps, every, kill_at = Path(sys.argv[1]), *(int(value) for value in sys.argv[2:5])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
fabric = Fabric(accelerator="cpu", strategy="ddp")
fabric.launch()
torch.manual_seed(7)
module = nn.Linear(8, 1)
model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9))
state = {"model": model, "optimizer": optimizer, "step": 0}
latest = out / "latest"
if latest.exists():
    fabric.load(out / latest.read_text().strip(), state)
started = {"started_at": state["step"], "pid": os.getpid()}
(out / f"attempt-{attempt}-rank{fabric.global_rank}.json").write_text(json.dumps(started))
while state["step"] < steps:
    generator = torch.Generator().manual_seed(1000 * int(state["step"]) + fabric.global_rank)
    inputs = torch.randn(16, 8, generator=generator)
    optimizer.zero_grad()
    fabric.backward(nn.functional.mse_loss(model(inputs), inputs.sum(dim=1, keepdim=True) * 0.5))
    optimizer.step()
    state["step"] += 1
    if state["step"] % every == 0:
        fabric.save(out / f"step-{state['step']}.ckpt", state)
        if fabric.global_rank == 0:
            (out / "latest.tmp").write_text(f"step-{state['step']}.ckpt")
            (out / "latest.tmp").replace(latest)
        fabric.barrier()
    if attempt == 0 and fabric.global_rank == 2 and state["step"] == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)  # as when its node fails
