"""Jobs where one rank waits in a collective the other never enters: ``python hang_jobs.py MODE TIMEOUT STALL``.

MODE: ``all_reduce``, ``all_gather``, ``broadcast`` or ``barrier`` (rank 0 alone calls it while rank 1 idles
after the first barrier), ``mismatch`` (rank 0 in all_reduce, rank 1 in a barrier), ``backward`` (rank 0 in
``fabric.backward`` of a DDP module, whose gradient all-reduce waits for rank 1, in a barrier). TIMEOUT and STALL
are seconds (the collectives' timeout and the stall threshold, 0: off).
"""

import sys
import time
from datetime import timedelta

import torch

from fabric import Fabric
from fabric.strategies.ddp import DDPStrategy

mode, timeout, stall = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
strategy = DDPStrategy(timeout=timedelta(seconds=timeout), stall_threshold=stall)
fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2)
fabric.launch()
model = fabric.setup_module(torch.nn.Linear(2, 1)) if mode == "backward" else None
fabric.barrier("start")  # both ranks are up
if fabric.global_rank == 0:
    lonely = {
        "all_reduce": lambda: fabric.all_reduce(torch.ones(1)),
        "all_gather": lambda: fabric.all_gather(torch.ones(1)),
        "broadcast": lambda: fabric.broadcast(torch.ones(1)),
        "barrier": lambda: fabric.barrier("lonely"),
        "mismatch": lambda: fabric.all_reduce(torch.ones(1)),
        "backward": lambda: fabric.backward(model(torch.ones(3, 2)).sum()),
    }[mode]
    lonely()  # LONELY CALL
elif mode in ("mismatch", "backward"):
    fabric.barrier("elsewhere")  # OTHER CALL
for _ in range(600):  # rank 1 idles until the job stops it
    time.sleep(0.1)
