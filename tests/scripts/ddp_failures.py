"""Jobs that go wrong on purpose: ``python ddp_failures.py MODE PID_DIR``.

MODE: ``child_raises`` (rank 1 raises), ``child_exits_3`` (rank 1 calls sys.exit(3)), ``child_exits_3_in_loop``
(rank 1 calls sys.exit(3) at step 20 of a loop of all_reduces, so rank 0 loses it mid-collective),
``child_exits_3_at_barrier`` (rank 1 calls sys.exit(3) while rank 0 waits in ``fabric.barrier("after work")``),
``rank0_raises``,
``only_rank0_barrier`` (rank 0 waits at a barrier that rank 1 never reaches), ``rank0_exits_7`` (rank 0 calls
sys.exit(7) while rank 1 enters an all_reduce), ``rank0_raises_systemexit_7`` (the same with ``raise
SystemExit(7)``), ``rank0_exits_7_training`` (rank 0 calls sys.exit(7) at step 3 of training a DDP-wrapped
model while rank 1 goes on to its gradient all-reduce), ``rank0_catches_exit`` (rank 0 catches its own
sys.exit(3) and reaches the end of the script before rank 1 ends). The collective timeout of the ``_7`` modes is 5
minutes, so only a prompt end of the job passes the test's time bound. It is 5 s for ``only_rank0_barrier``, whose
barrier is to time out, and otherwise 60 s: the timeout also bounds how long rank 0 waits for rank 1 to join, which
took more than 5 s on a loaded 2-core machine.
"""

import contextlib
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

from fabric import Fabric
from fabric.strategies.ddp import DDPStrategy

mode, pid_dir = sys.argv[1], Path(sys.argv[2])
timeout = timedelta(seconds=300 if mode.startswith("rank0_") and "_7" in mode else 5 if "barrier" in mode else 60)
fabric = Fabric(accelerator="cpu", strategy=DDPStrategy(timeout=timeout), devices=2)
fabric.launch()
pid_dir.mkdir(parents=True, exist_ok=True)
pid_file = pid_dir / f".rank{fabric.global_rank}.pid.tmp"
pid_file.write_text(str(os.getpid()))
pid_file.rename(pid_dir / f"rank{fabric.global_rank}.pid")  # whole, never seen empty by the test polling for it
fabric.barrier()  # both ranks are up
if mode == "child_raises" and fabric.global_rank == 1:
    raise ValueError("rank 1 fails on purpose")
if mode == "child_exits_3" and fabric.global_rank == 1:
    sys.exit(3)
if mode == "child_exits_3_in_loop":
    for step in range(1000):
        if step == 20 and fabric.global_rank == 1:
            sys.exit(3)
        fabric.all_reduce(torch.ones(1))
if mode == "child_exits_3_at_barrier":
    if fabric.global_rank == 1:
        sys.exit(3)
    fabric.barrier("after work")
if mode == "rank0_raises" and fabric.global_rank == 0:
    raise ValueError("rank 0 fails on purpose")
if mode in ("rank0_exits_7", "rank0_raises_systemexit_7"):
    if fabric.global_rank == 0:
        if mode == "rank0_exits_7":
            sys.exit(7)
        raise SystemExit(7)
    fabric.all_reduce(torch.ones(1))
if mode == "rank0_exits_7_training":
    model = torch.nn.Linear(4, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(10):
        if step == 3 and fabric.global_rank == 0:
            sys.exit(7)
        optimizer.zero_grad()
        fabric.backward(model(torch.randn(8, 4)).sum())
        optimizer.step()
if mode == "rank0_catches_exit":  # a sys.exit that rank 0 catches must not count as rank 0 leaving
    if fabric.global_rank == 0:
        with contextlib.suppress(SystemExit):
            sys.exit(3)
    else:
        time.sleep(1.0)  # rank 0 reaches the end of the script first, then rank 1 finishes its work
        (pid_dir / "rank1.done").write_text("done")
if mode == "only_rank0_barrier":
    if fabric.global_rank == 0:
        fabric.barrier("only rank 0")
    else:
        fabric.all_reduce(torch.ones(1))
if mode != "rank0_catches_exit":  # the surviving ranks keep working until they are stopped
    for _ in range(600):
        time.sleep(0.1)
