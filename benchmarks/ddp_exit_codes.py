"""Do 2-rank DDP jobs exit cleanly? Exit codes of many identical short jobs, raw PyTorch vs Fabric.

What is measured
----------------
torch 2.13 with gloo sometimes aborts a rank during interpreter shutdown, after all the work is done:
the process prints ``terminate called without an active exception`` and dies of SIGABRT, so a job that
trained correctly still exits non-zero. Fabric claims its ranks release the process group and the DDP
wrappers at exit, so its jobs always exit 0. This script runs the same short job (``--steps`` 20
steps of a tiny MLP, batch 64 per rank, 2 CPU ranks, gloo; the DDP-wrapped model stays referenced at
module level until the end of the script, as users write it) ``--runs`` times per variant:

* **raw, no cleanup**: ``benchmarks/ddp_jobs/raw_ddp_job.py --cleanup none`` under torchrun (what most
  user scripts do: no ``destroy_process_group()``);
* **raw + destroy**: the same with ``destroy_process_group()`` at the end (the tutorials' advice);
* **fabric, in-script**: ``benchmarks/ddp_jobs/fabric_ddp_job.py`` started as ``python job.py``
  (``fabric.launch()`` starts rank 1);
* **fabric + torchrun**: the same Fabric script under torchrun.

Launch: torchrun is ``python -m torch.distributed.run --nnodes=1 --nproc_per_node=2`` with
``--master_port`` a free port (a socket bound to port 0) for every run. The variants are interleaved
(run 1 of each variant, then run 2 of each, rotating which goes first) so changes in machine load hit
all of them alike. Each run has a timeout (``--timeout``, 60 s); a run that exceeds it is killed
(its whole process group) and counted as a failure.

How a failure shows up
----------------------
A rank dying of SIGABRT shows as exit code -6 (a Python parent's view of a signal), or 134 (128 + 6, a
shell's view, which Fabric's launcher reports when it ends the job because rank 1 died), or torchrun's
exit code 1 with ``exitcode: -6`` in its error summary. The table counts, per variant, exit 0,
non-zero exits with their codes, timeouts, runs whose stderr contains ``terminate called without an
active exception``, the worker exit codes torchrun reported, and runs whose job did not print its
result line (the work itself did not finish) or whose two ranks ended with different parameters.

How to read it
--------------
``non-zero`` is what a scheduler or CI would see as a failed job. On this machine about 1 in 10
plain two-rank gloo jobs abort (up to half under load); Fabric's claim is 0. ``P(0 | raw rate)`` is
the chance of seeing Fabric's count of failures or fewer if Fabric failed as often as raw DDP without
cleanup did here: small values mean the difference is not luck. ``95% upper bound`` is the highest
failure rate compatible with the observed count (one-sided Clopper-Pearson). The load average is
printed before, after, and its maximum during the runs, since load raises the abort rate. For the
first failing run of every variant the end of its stderr is printed (the whole stderr for Fabric's).

Usage::

    python benchmarks/ddp_exit_codes.py                   # 50 runs per variant, ~20 minutes on 2 cores
    python benchmarks/ddp_exit_codes.py --quick           # 3 runs per variant
    python benchmarks/ddp_exit_codes.py --runs 200 --variants raw-none,fabric-script
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math
import os
import re
import signal
import subprocess
import tempfile
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

TERMINATE_MESSAGE = "terminate called without an active exception"
# torchrun's error summary: one "rank : R (local_rank: L)" line followed by "exitcode : C" per failed worker.
TORCHRUN_EXITCODE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
FABRIC_RANK_FAILURE = re.compile(r"fabric: local rank (\d+) \(pid \d+\) exited with code (-?\d+)")


VARIANTS: tuple[Variant, ...] = (
    Variant("raw-none", "raw DDP + torchrun, no cleanup", RAW_JOB, True, ("--cleanup", "none")),
    Variant("raw-destroy", "raw DDP + torchrun, destroy_process_group()", RAW_JOB, True, ("--cleanup", "destroy")),
    Variant("fabric-script", "fabric, in-script (python job.py)", FABRIC_JOB, False),
    Variant("fabric-torchrun", "fabric + torchrun", FABRIC_JOB, True),
)


@dataclass(frozen=True)
class Run:
    variant: Variant
    index: int
    returncode: int | None  # None: timed out
    seconds: float
    terminate_messages: int
    worker_codes: tuple[int, ...]  # one per failed rank, from torchrun's summary or Fabric's failure line
    finished_work: bool
    replicas_identical: bool
    stderr: str

    @property
    def failed(self) -> bool:
        return self.returncode != 0


def run_job(variant: Variant, index: int, steps: int, timeout: float, env: dict[str, str]) -> Run:
    start = time.perf_counter()
    process = subprocess.Popen(
        command(variant, steps, warmup=steps // 4),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, so a timeout can stop every rank it started
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        returncode: int | None = process.returncode
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # the group may have ended meanwhile
            os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        returncode = None
    seconds = time.perf_counter() - start
    by_rank = {int(rank): int(code) for rank, code in TORCHRUN_EXITCODE.findall(stderr)}
    by_rank.update({int(rank): int(code) for rank, code in FABRIC_RANK_FAILURE.findall(stderr)})
    result_lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    return Run(
        variant=variant,
        index=index,
        returncode=returncode,
        seconds=seconds,
        terminate_messages=stderr.count(TERMINATE_MESSAGE),
        worker_codes=tuple(code for _, code in sorted(by_rank.items())),
        finished_work=bool(result_lines),
        replicas_identical=any('"replicas_identical": true' in line for line in result_lines),
        stderr=stderr,
    )


def describe_code(code: int | None) -> str:
    if code is None:
        return "timeout"
    if code < 0:
        return f"{code} ({signal.Signals(-code).name})" if -code in signal.valid_signals() else str(code)
    if code > 128 and (code - 128) in signal.valid_signals():
        return f"{code} ({signal.Signals(code - 128).name})"
    return str(code)


def upper_bound(failures: int, runs: int, confidence: float = 0.95) -> float:
    """One-sided Clopper-Pearson upper bound of a failure rate, by bisection on the binomial tail."""
    if failures >= runs:
        return 1.0
    low, high = failures / runs, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if binomial_cdf(failures, runs, mid) > 1 - confidence:
            low = mid
        else:
            high = mid
    return high


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


def _counts(values: Sequence[str]) -> str:
    if not values:
        return "-"
    return ", ".join(f"{value} x{count}" for value, count in sorted(collections.Counter(values).items()))


def format_table(runs: Sequence[Run], variants: Sequence[Variant]) -> str:
    lines = [
        '| variant | launch | runs | exit 0 | non-zero | exit codes (non-zero) | "terminate called" runs '
        "| rank exit codes reported | timeouts | work unfinished | replicas differ | median s/run |",
        "|---|---|---:|---:|---:|---|---:|---|---:|---:|---:|---:|",
    ]
    for variant in variants:
        mine = [run for run in runs if run.variant is variant]
        failed = [run for run in mine if run.failed]
        seconds = sorted(run.seconds for run in mine)
        lines.append(
            f"| {variant.key} | {variant.description} | {len(mine)} | {len(mine) - len(failed)} | {len(failed)} "
            f"| {_counts([describe_code(run.returncode) for run in failed])} "
            f"| {sum(1 for run in mine if run.terminate_messages)} "
            f"| {_counts([describe_code(code) for run in mine for code in run.worker_codes])} "
            f"| {sum(1 for run in mine if run.returncode is None)} "
            f"| {sum(1 for run in mine if not run.finished_work)} "
            f"| {sum(1 for run in mine if run.finished_work and not run.replicas_identical)} "
            f"| {seconds[len(seconds) // 2] if seconds else float('nan'):.2f} |"
        )
    return "\n".join(lines)


def statistics_notes(runs: Sequence[Run], variants: Sequence[Variant]) -> list[str]:
    by_key = {v.key: [run for run in runs if run.variant is v] for v in variants}
    lines = []
    raw = by_key.get("raw-none")
    raw_rate = sum(run.failed for run in raw) / len(raw) if raw else None
    for variant in variants:
        mine = by_key[variant.key]
        failures = sum(run.failed for run in mine)
        line = (
            f"- {variant.key}: {failures}/{len(mine)} failed ({failures / len(mine):.0%}); "
            f"95% upper bound on its failure rate: {upper_bound(failures, len(mine)):.1%}"
        )
        if variant.key.startswith("fabric") and raw_rate:
            chance = binomial_cdf(failures, len(mine), raw_rate)
            line += f"; P(<= {failures} failures | raw-none's rate {raw_rate:.0%}) = {chance:.2g}"
        lines.append(line)
    return lines


def failure_reports(runs: Sequence[Run], variants: Sequence[Variant]) -> list[str]:
    lines = []
    for variant in variants:
        failed = [run for run in runs if run.variant is variant and run.failed]
        if not failed:
            continue
        run = failed[0]
        text = run.stderr.strip()
        what = "full stderr"
        if not variant.key.startswith("fabric"):  # raw failures are expected: an excerpt suffices
            text, what = excerpt(text), "stderr excerpt (key lines, then the end)"
        lines.append(
            f"\n## first failure of {variant.key} (run {run.index + 1}, exit {describe_code(run.returncode)}): "
            f"{what}\n```\n{text}\n```"
        )
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=50, help="runs per variant (default 50)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per job (default 20)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per run before it is killed (default 60)")
    parser.add_argument(
        "--variants",
        default=",".join(v.key for v in VARIANTS),
        help=f"comma-separated subset of: {', '.join(v.key for v in VARIANTS)} (default: all)",
    )
    parser.add_argument("--inherit-env", action="store_true", help="no private bytecode cache for the jobs")
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 runs per variant")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs = 3
    if args.runs < 1 or args.steps < 2:
        parser.error("--runs must be at least 1 and --steps at least 2")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    known = {v.key: v for v in VARIANTS}
    keys = [key.strip() for key in args.variants.split(",") if key.strip()]
    unknown = sorted(set(keys) - set(known))
    if unknown:
        raise SystemExit(f"Unknown variant(s) {unknown}; choose from {sorted(known)}.")
    variants = [known[key] for key in keys]
    import torch  # only for the header; the jobs import it themselves

    print(
        f"# Exit codes of 2-rank DDP jobs | torch {torch.__version__} | gloo, CPU | {os.cpu_count()} cores "
        f"| {args.steps} steps, MLP 32-64-10, batch 64/rank | {args.runs} runs per variant, interleaved "
        f"| timeout {args.timeout:.0f} s"
    )
    print(f"# load average before: {load_average()}\n", flush=True)

    runs: list[Run] = []
    max_load = os.getloadavg()[0]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fabric-ddp-exit-pycache-") as cache:
        env = child_env(None if args.inherit_env else Path(cache))
        for variant in variants:  # untimed, uncounted: fills the file and bytecode caches
            run_job(variant, -1, args.steps, args.timeout, env)
        for index in range(args.runs):
            shift = index % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                run = run_job(variant, index, args.steps, args.timeout, env)
                runs.append(run)
                max_load = max(max_load, os.getloadavg()[0])
                if run.failed:
                    print(
                        f"  run {index + 1} {variant.key}: exit {describe_code(run.returncode)}, "
                        f"worker codes {list(run.worker_codes)}, 'terminate called' x{run.terminate_messages}",
                        flush=True,
                    )
            if (index + 1) % 10 == 0 or index + 1 == args.runs:
                failed = collections.Counter(run.variant.key for run in runs if run.failed)
                summary = ", ".join(f"{v.key} {failed[v.key]}" for v in variants)
                print(
                    f"  {index + 1}/{args.runs} runs per variant, failures so far: {summary} "
                    f"(load {load_average()}, {time.perf_counter() - started:.0f} s)",
                    flush=True,
                )

    print(f"\n# load average after: {load_average()}; highest 1-minute load average seen: {max_load:.2f}\n")
    print(format_table(runs, variants))
    print()
    for line in statistics_notes(runs, variants):
        print(line)
    for line in failure_reports(runs, variants):
        print(line)


if __name__ == "__main__":
    main()
