"""The benchmark job through Fabric: the same training as ``raw_ddp_job.py``, written the Fabric way.
Start it either way::

    python benchmarks/ddp_jobs/fabric_ddp_job.py --steps 200 --warmup 50                  # Fabric starts rank 1
    torchrun --nproc_per_node=2 benchmarks/ddp_jobs/fabric_ddp_job.py --steps 200 --warmup 50

``Fabric(accelerator="cpu", strategy="ddp", devices=2)`` + ``fabric.launch()``; the model and optimizer
go through ``fabric.setup``, the loader (a plain shuffling ``DataLoader``) through
``fabric.setup_dataloaders``, which turns it into a ``DistributedSampler`` with the seed of
``seed_everything`` and reshuffles each epoch. Same seed, data, model, optimizer and batch order as
the raw job, so the final parameters are bitwise identical to its. The script does no cleanup of its
own and keeps the model referenced until interpreter shutdown: Fabric's exit handling is what is
tested. Rank 0 prints ``DDP_JOB_RESULT {json}`` like the raw job.
Used by ``benchmarks/ddp.py`` and ``benchmarks/ddp_exit_codes.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from job_data import BATCH_SIZE, SEED, make_dataset, make_model
from torch import nn
from torch.utils.data import DataLoader

from fabric import Fabric


def train(fabric: Fabric, steps: int, warmup: int) -> tuple[nn.Module, dict[str, object]]:
    """Train; return the set-up model (the caller keeps it alive) and rank 0's report."""
    torch.set_num_threads(1)
    fabric.seed_everything(SEED)
    dataset = make_dataset(fabric.world_size)
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True, drop_last=True))
    model = make_model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))

    step, start, stamps = 0, 0.0, [0.0]
    while step < steps:
        for x, y in loader:
            if step == warmup:
                fabric.barrier()
                start = time.perf_counter()
                stamps = [start]
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            step += 1
            if step > warmup:
                stamps.append(time.perf_counter())
            if step == steps:
                break
    # Total time of the timed steps and the median step, each the larger of the two ranks'.
    durations = [later - earlier for earlier, later in itertools.pairwise(stamps)]
    timings = torch.tensor([stamps[-1] - start, statistics.median(durations or [0.0])], dtype=torch.float64)
    timings = fabric.all_reduce(timings, reduce_op="max")

    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    replicas = fabric.all_gather(flat)
    report: dict[str, object] = {
        "job": "fabric",
        "world_size": fabric.world_size,
        "steps": steps,
        "timed_steps": steps - warmup,
        "us_per_step": timings[0].item() / max(1, steps - warmup) * 1e6,
        "median_step_us": timings[1].item() * 1e6,
        "replicas_identical": all(torch.equal(replicas[0], r) for r in replicas),
        "param_hash": hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16],
        "final_loss": loss.item(),
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
    }
    return model, report


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Fabric DDP benchmark job (run it directly or with torchrun).")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=50, help="untimed steps before the barrier")
    return parser.parse_args()


args = parse_args()
fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
fabric.launch()
# Module level on purpose: the model stays referenced until the interpreter shuts down, as in a
# typical training script.
model, report = train(fabric, args.steps, args.warmup)
if fabric.global_rank == 0:
    print("DDP_JOB_RESULT " + json.dumps(report), flush=True)
