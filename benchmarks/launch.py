"""Whole-job wall time of one small 2-rank DDP job started three ways, compared with torchrun.

The job is ``benchmarks/ddp_jobs/fabric_ddp_job.py`` (tiny MLP, 200 steps, 2 CPU ranks over gloo),
started by

- ``torchrun --nproc_per_node=2 job.py`` (the reference),
- ``python job.py`` (Fabric's in-script launch starts rank 1 itself),
- ``fabric run model --devices=2 job.py`` (the CLI starts both ranks).

Wall time covers everything a user waits for: interpreter start, imports, rendezvous, training,
shutdown. Rounds are interleaved (each round runs every launcher once, in rotating order) and the
medians are compared, which keeps slow drifts of a shared 2-core machine out of the ratios.

    python benchmarks/launch.py --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
from ddp_launching import FABRIC_JOB, child_env, find_free_port

JOB = FABRIC_JOB


def _commands(steps: int) -> dict[str, list[str]]:
    job = [str(JOB), "--steps", str(steps), "--warmup", str(min(50, steps // 4))]
    return {
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port={port}", *job],
        "python job.py (in-script launch)": [sys.executable, *job],
        "fabric run model": [sys.executable, "-m", "fabric_cli", "run", "model", "--devices=2", *job],
    }


def _time_once(command: list[str]) -> float:
    command = [part.replace("{port}", str(find_free_port())) for part in command]
    environment = child_env(pycache_prefix=None)
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=300, check=False)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {result.returncode}:\n{result.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per job (default 200)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 40 steps")
    args = parser.parse_args()
    rounds, steps = (2, 40) if args.quick else (args.rounds, args.steps)

    commands = _commands(steps)
    names = list(commands)
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(1):  # warm-up: file caches, bytecode
        for name in names:
            _time_once(commands[name])
    for round_index in range(rounds):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            times[name].append(_time_once(commands[name]))

    print(f"# 2-rank DDP job, {steps} steps | torch {torch.__version__} | cpus {os.cpu_count()}")
    print(f"# {rounds} interleaved rounds; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print()
    print("| launcher | median s | min s | max s | vs torchrun |")
    print("|---|---:|---:|---:|---:|")
    reference = statistics.median(times["torchrun"])
    for name in names:
        median = statistics.median(times[name])
        print(f"| {name} | {median:.2f} | {min(times[name]):.2f} | {max(times[name]):.2f} | {median / reference:.3f} |")
    print()
    print("Target: at most 1.05x torchrun for each Fabric launcher.")


if __name__ == "__main__":
    main()
