"""The benchmark job in plain PyTorch: ``init_process_group("gloo")`` + ``DistributedDataParallel`` +
``DistributedSampler``, written the way the PyTorch tutorials write it. Start it with torchrun::

    torchrun --nproc_per_node=2 benchmarks/ddp_jobs/raw_ddp_job.py --steps 200 --warmup 50 --cleanup destroy

Each rank trains a tiny MLP (32-64-10, SGD with momentum) on synthetic data made here (batch 64 per
rank) for ``--steps`` optimizer steps. After ``--warmup`` steps the ranks meet at a barrier and the
remaining steps are timed; rank 0 then prints one line ``DDP_JOB_RESULT {json}`` with the steady-state
microseconds per step and the median single step (each the slower rank's), whether both ranks ended
with bitwise identical parameters, and a hash of those parameters (identical across the raw and
Fabric jobs: same seed, data and batch order).

``--cleanup none`` ends the script with the process group and the DDP model still alive (what most
user scripts do); ``--cleanup destroy`` calls ``destroy_process_group()`` at the end (the tutorials'
advice) while the DDP model stays referenced until interpreter shutdown, as in a typical script.
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
import torch.distributed as dist
import torch.nn.functional as F
from job_data import BATCH_SIZE, SEED, make_dataset, make_model
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler


def train(steps: int, warmup: int) -> tuple[nn.Module, dict[str, object]]:
    """Train; return the DDP model (the caller keeps it alive) and rank 0's report."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(SEED)
    dataset = make_dataset(world_size)
    sampler: DistributedSampler[int] = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED
    )
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler, drop_last=True)
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    step, epoch, start, stamps = 0, 0, 0.0, [0.0]
    while step < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            if step == warmup:
                dist.barrier()
                start = time.perf_counter()
                stamps = [start]
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            step += 1
            if step > warmup:
                stamps.append(time.perf_counter())
            if step == steps:
                break
        epoch += 1
    # Total time of the timed steps and the median step, each the larger of the two ranks'.
    durations = [later - earlier for earlier, later in itertools.pairwise(stamps)]
    timings = torch.tensor([stamps[-1] - start, statistics.median(durations or [0.0])], dtype=torch.float64)
    dist.all_reduce(timings, op=dist.ReduceOp.MAX)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    replicas = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(replicas, flat)
    report: dict[str, object] = {
        "job": "raw",
        "world_size": world_size,
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
    parser = argparse.ArgumentParser(description="Plain-PyTorch DDP benchmark job (start it with torchrun).")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=50, help="untimed steps before the barrier")
    parser.add_argument("--cleanup", choices=("none", "destroy"), default="none")
    return parser.parse_args()


args = parse_args()
# Module level on purpose: the DDP model stays referenced until the interpreter shuts down, as in a
# typical training script.
model, report = train(args.steps, args.warmup)
if dist.get_rank() == 0:
    print("DDP_JOB_RESULT " + json.dumps(report), flush=True)
if args.cleanup == "destroy":
    dist.destroy_process_group()
