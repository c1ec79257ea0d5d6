"""Cost of Fabric for a 2-process DDP job on CPU (gloo), against the same job in raw PyTorch.

What is measured
----------------
One fixed job, three ways to run it on 2 CPU ranks:

* **(a) raw + torchrun**: ``benchmarks/ddp_jobs/raw_ddp_job.py``, plain PyTorch
  (``init_process_group("gloo")``, ``DistributedDataParallel``, ``DistributedSampler``,
  ``destroy_process_group()`` at the end), started by ``python -m torch.distributed.run --nproc_per_node=2``.
  This is the reference for every ratio.
* **(b) fabric, in-script**: ``benchmarks/ddp_jobs/fabric_ddp_job.py`` started as ``python job.py``;
  ``Fabric(accelerator="cpu", strategy="ddp", devices=2).launch()`` starts rank 1 itself.
* **(c) fabric + torchrun**: the same Fabric script started by torchrun (``fabric.launch()`` only joins).

The job: MLP 32-64-10, SGD with momentum, batch 64 per rank, 200 optimizer steps, synthetic data
made in the script (no downloads), ``torch.set_num_threads(1)`` in each rank. Both scripts use the
same seed, data, initial weights and batch order, so all three variants end with bitwise identical
parameters (the notes show a hash of them, and whether the two ranks of every run agreed).

Per variant:

* **whole job**: wall time of the launching command, from ``subprocess`` start to exit, measured
  here; it includes interpreter start-up, ``import torch``, the rendezvous, training, and shutdown
  (for torchrun also its agent process). It is split at the moment rank 0's result line arrives
  (training and the final checks are done then): ``start+train`` before it, ``shutdown`` after it
  (the ranks' exit handling and interpreter shutdown, and for torchrun the agent noticing and exiting).
* **steady state**: measured inside the job. After 50 steps (``--warmup``) the ranks meet at a
  barrier, steps 50..200 are timed with ``time.perf_counter``, and rank 0 prints the slower rank's
  mean microseconds per step (``steady us/step``, the headline) and median single step (``median
  step us``, insensitive to a few steps lost to preemption) in a ``DDP_JOB_RESULT {json}`` line
  that this script parses.

How it is measured
------------------
Each variant runs once untimed (file cache, bytecode cache). Then ``--rounds`` rounds each run all
three variants one after the other, rotating which goes first, so slow drifts of the machine load hit
them alike. The table shows medians over the rounds and the ratio of medians to (a). ``paired`` is
the ratio to (a) within each round (runs seconds apart, under the same load): its median and, in
brackets, its smallest and largest value; a wide range means a busy machine, and the paired median
is then the more robust estimate. The load average before and after is printed for the same reason.
A run that exits non-zero (or prints no result) is left out of the medians and listed under the
table with an excerpt of its stderr; ``ok runs`` counts the others. A job still running after
120 s is killed with its process group.

Bytecode: the jobs get a private, temporary bytecode cache (``PYTHONPYCACHEPREFIX``, with
``PYTHONDONTWRITEBYTECODE`` removed), filled by the untimed run, as in an ordinary installation.
Otherwise an environment that sets ``PYTHONDONTWRITEBYTECODE`` would recompile the editable fabric
checkout in every process but not torch. ``--inherit-env`` passes this environment unchanged.
Each torchrun run gets a free port (bound to port 0) for ``--master_port``.

How to read it
--------------
Targets (from the issue): steady state of (b) and (c) within 1.03x of (a); whole job of (b) and (c) within 1.05x of
(a). A step here is ~1-3 ms, dominated by the gloo all-reduce between two processes, so a few
percent is within noise on a shared 2-core machine: look at the paired range before reading a
difference into it.

Usage::

    python benchmarks/ddp.py                  # 9 rounds, ~3 minutes on 2 cores
    python benchmarks/ddp.py --quick          # 2 rounds, 60 steps
    python benchmarks/ddp.py --rounds 11
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ddp_launching import (
    FABRIC_JOB,
    RAW_JOB,
    RESULT_PREFIX,
    Variant,
    child_env,
    command,
    excerpt,
    load_average,
)

STEADY_TARGET = 1.03
WHOLE_JOB_TARGET = 1.05
TIMEOUT_SECONDS = 120.0


VARIANTS: tuple[Variant, ...] = (
    Variant("a", "raw DDP + torchrun", RAW_JOB, torchrun=True, extra_args=("--cleanup", "destroy")),
    Variant("b", "fabric, in-script (python job.py)", FABRIC_JOB, torchrun=False),
    Variant("c", "fabric + torchrun", FABRIC_JOB, torchrun=True),
)


@dataclass(frozen=True)
class Run:
    variant: Variant
    wall_seconds: float
    result_seconds: float | None  # launch to rank 0's result line: start-up and training
    returncode: int | None  # None: timed out
    result: dict[str, object] | None
    stderr: str


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def run_job(variant: Variant, steps: int, warmup: int, env: dict[str, str]) -> Run:
    """Run one job; time it whole, and until rank 0's result line arrives (training is over then)."""
    cmd = command(variant, steps, warmup)
    with tempfile.TemporaryFile(mode="w+") as stderr_file:
        start = time.perf_counter()
        process = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=stderr_file, text=True, start_new_session=True
        )
        # A timeout kills the job's own process group (start_new_session): its ranks too.
        timer = threading.Timer(TIMEOUT_SECONDS, _kill_group, (process.pid,))
        timer.start()
        result, result_seconds = None, None
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith(RESULT_PREFIX):
                result_seconds = time.perf_counter() - start
                result = json.loads(line[len(RESULT_PREFIX) :])
        returncode: int | None = process.wait()
        wall = time.perf_counter() - start
        timed_out = not timer.is_alive()
        timer.cancel()
        if timed_out:
            returncode = None
        stderr_file.seek(0)
        stderr = stderr_file.read()
    return Run(variant, wall, result_seconds, returncode, result, stderr)


def _metric(run: Run, metric: str) -> float | None:
    """``wall``: whole-job seconds, ``to_result``: launch to the result line, ``shutdown``: from there to the
    exit; ``us`` / ``median_us``: the job's own steady-state figures."""
    if metric == "wall":
        return run.wall_seconds
    if metric in ("to_result", "shutdown"):
        if run.result_seconds is None:
            return None
        return run.result_seconds if metric == "to_result" else run.wall_seconds - run.result_seconds
    key = {"us": "us_per_step", "median_us": "median_step_us"}[metric]
    value = run.result.get(key) if run.result else None
    return float(value) if isinstance(value, (int, float)) else None


def _ok(run: Run) -> bool:
    return run.returncode == 0 and _metric(run, "us") is not None


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _medians(rounds: Sequence[dict[str, Run]], key: str, metric: str) -> float:
    """Median of ``metric`` over the successful runs of variant ``key``."""
    return _median([value for r in rounds if _ok(r[key]) and (value := _metric(r[key], metric)) is not None])


def _paired(rounds: Sequence[dict[str, Run]], key: str, metric: str) -> list[float]:
    """Per round, ``metric`` of variant ``key`` over that of (a), for rounds where both succeeded."""
    ratios = []
    for runs in rounds:
        if _ok(runs["a"]) and _ok(runs[key]):
            value, reference = _metric(runs[key], metric), _metric(runs["a"], metric)
            if value is not None and reference:
                ratios.append(value / reference)
    return ratios


def _range(values: Sequence[float]) -> str:
    if not values:
        return "n/a"
    return f"{_median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


# (metric, column title, format, shown as ratio to (a) with paired range, or as value and difference to (a))
METRICS: tuple[tuple[str, str, str, bool], ...] = (
    ("wall", "whole job s", "{:.3f}", True),
    ("to_result", "start+train s", "{:.3f}", False),
    ("shutdown", "shutdown s", "{:.3f}", False),
    ("us", "steady us/step", "{:,.0f}", True),
    ("median_us", "median step us", "{:,.0f}", True),
)


def format_table(rounds: Sequence[dict[str, Run]]) -> str:
    header, align = "| variant | ok runs |", "|---|---:|"
    for _, title, _, as_ratio in METRICS:
        header += f" {title} | vs (a) | paired [min-max] |" if as_ratio else f" {title} (vs (a)) |"
        align += "---:|---:|---|" if as_ratio else "---:|"
    lines = [header, align]
    for variant in VARIANTS:
        ok = sum(1 for r in rounds if _ok(r[variant.key]))
        cells = [f"({variant.key}) {variant.description}", f"{ok}/{len(rounds)}"]
        for metric, _, fmt, as_ratio in METRICS:
            value, reference = _medians(rounds, variant.key, metric), _medians(rounds, "a", metric)
            if not as_ratio:
                cells.append(fmt.format(value) + ("" if variant.key == "a" else f" ({value - reference:+.3f})"))
            elif variant.key == "a":
                cells += [fmt.format(value), "1.000", "-"]
            else:
                cells += [fmt.format(value), f"{value / reference:.3f}", _range(_paired(rounds, variant.key, metric))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def notes(rounds: Sequence[dict[str, Run]]) -> list[str]:
    lines: list[str] = []
    hashes: set[str] = set()
    for variant in VARIANTS:
        runs = [r[variant.key] for r in rounds]
        results = [run.result for run in runs if run.result is not None]
        identical = sum(1 for res in results if res.get("replicas_identical") is True)
        hashes.update(str(res.get("param_hash")) for res in results)
        threads = sorted({str(res.get("threads")) for res in results})
        lines.append(
            f"- ({variant.key}) {variant.description}: both ranks ended with identical parameters in "
            f"{identical}/{len(runs)} runs; threads per rank: {', '.join(threads) or 'n/a'}"
        )
    lines.append(
        f"- final-parameter hash over all runs of all variants: {', '.join(sorted(hashes))} "
        f"({'one value: every run did identical work' if len(hashes) == 1 else 'DIFFERENT values'})"
    )
    for variant in VARIANTS[1:]:
        steady, median_step, whole = (
            _medians(rounds, variant.key, metric) / _medians(rounds, "a", metric)
            for metric in ("us", "median_us", "wall")
        )
        lines.append(
            f"- ({variant.key}) steady state {steady:.3f}x raw DDP (median step {median_step:.3f}x; "
            f"target <= {STEADY_TARGET:.2f}): {'PASS' if steady <= STEADY_TARGET else 'FAIL'}; "
            f"whole job {whole:.3f}x raw torchrun (target <= {WHOLE_JOB_TARGET:.2f}): "
            f"{'PASS' if whole <= WHOLE_JOB_TARGET else 'FAIL'}"
        )
    failures = [run for runs in rounds for run in runs.values() if not _ok(run)]
    if not failures:
        lines.append("- every timed run exited 0 and reported its result")
    for run in failures:
        code = "timeout" if run.returncode is None else f"exit {run.returncode}"
        lines.append(
            f"- FAILED run of ({run.variant.key}) {run.variant.description} (left out of the table): {code}; "
            f"stderr excerpt:\n```\n{excerpt(run.stderr)}\n```"
        )
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per job (default 200)")
    parser.add_argument("--warmup", type=int, default=50, help="untimed steps before the timed ones (default 50)")
    parser.add_argument("--inherit-env", action="store_true", help="no private bytecode cache for the jobs")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 60 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 60, 20
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 0 and smaller than --steps")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    import torch  # only for the header; the jobs import it themselves

    print(
        f"# Fabric DDP job vs raw DDP | torch {torch.__version__} | 2 ranks, gloo, CPU | {os.cpu_count()} cores "
        f"| MLP 32-64-10, batch 64/rank, {args.steps} steps, steps {args.warmup}..{args.steps} timed, 1 thread/rank"
    )
    print(f"# medians over {args.rounds} interleaved rounds; ratios vs (a) raw DDP + torchrun")
    print(
        f"# targets (from the issue): steady state within {STEADY_TARGET:.2f}x of raw DDP, "
        f"whole job within {WHOLE_JOB_TARGET:.2f}x of torchrun"
    )
    print(f"# load average before: {load_average()}\n", flush=True)

    with tempfile.TemporaryDirectory(prefix="fabric-ddp-bench-pycache-") as cache:
        env = child_env(None if args.inherit_env else Path(cache))
        for variant in VARIANTS:  # untimed: fills the file and bytecode caches
            warm = run_job(variant, args.steps, args.warmup, env)
            print(f"  warm-up ({variant.key}): exit {warm.returncode}, {warm.wall_seconds:.2f} s", flush=True)
        rounds: list[dict[str, Run]] = []
        for index in range(args.rounds):
            order = VARIANTS[index % len(VARIANTS) :] + VARIANTS[: index % len(VARIANTS)]
            runs = {variant.key: run_job(variant, args.steps, args.warmup, env) for variant in order}
            rounds.append(runs)
            summary = ", ".join(
                f"({v.key}) {runs[v.key].wall_seconds:.2f} s / {_metric(runs[v.key], 'us') or float('nan'):,.0f} us"
                for v in VARIANTS
            )
            print(f"  round {index + 1}/{args.rounds}: {summary}", flush=True)

    print(f"\n# load average after: {load_average()}\n")
    print(format_table(rounds))
    print()
    for line in notes(rounds):
        print(line)


if __name__ == "__main__":
    main()
