"""Plain torch DDP (no Fabric) under ``torchrun --max-restarts=1``: rank 1 SIGKILLs itself in the first attempt.

Joins with ``init_process_group("gloo")`` (env://) as torch documents; succeeds when the restarted attempt
finishes its 20 steps.
"""

import datetime
import os
import signal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
model = DistributedDataParallel(nn.Linear(8, 8))
for step in range(20):
    model(torch.randn(4, 8)).sum().backward()
    if attempt == 0 and step == 5 and dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
dist.destroy_process_group()
