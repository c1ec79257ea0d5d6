"""What importing Fabric (and constructing one) costs on top of ``import torch``.

What is measured
----------------
The wall time of fresh interpreter processes, ``python -c <snippet>``, for these snippets:

* ``pass`` (interpreter start-up alone, for reference),
* ``import torch`` (the baseline everything else is compared with),
* ``import torch, fabric`` (the package itself: its public names load lazily, so this should be ~0),
* ``import torch; from fabric import Fabric`` (the core modules: connector, strategies, plugins, ...),
* ``import torch; from fabric import Fabric; Fabric(accelerator='cpu')`` (plus resolving a CPU setup),
* ``import torch; from fabric.trainer import Trainer`` (the Trainer and everything it loads; target < 300 ms).

Bytecode: by default the child processes get a private, temporary bytecode cache
(``PYTHONPYCACHEPREFIX``; ``PYTHONDONTWRITEBYTECODE`` is removed from their environment), so every
module -- torch's, fabric's, their dependencies' -- is compiled once in the warm-up and loaded from
``.pyc`` afterwards, as in an ordinary installation. Without this, an environment that sets
``PYTHONDONTWRITEBYTECODE`` while fabric is an editable checkout without ``__pycache__`` would recompile
fabric's sources in every process but not torch's, inflating fabric's share. ``--inherit-env`` runs
the children with the environment as it is instead. Nothing is written inside the repository.

Each snippet runs once untimed (to warm the OS file cache and the bytecode cache), then all
snippets run in interleaved rounds (snippet 1, 2, ..., 1, 2, ...), so drifts in machine load affect
every snippet alike. Time is taken with ``time.perf_counter`` around ``subprocess.run`` and includes
interpreter start-up and shutdown. The table shows the median and the minimum over the rounds, the
difference of the medians to ``import torch``, and the paired difference: in each round the snippet's
time minus that round's ``import torch`` time (runs seconds apart, so under the same machine load),
median over the rounds.

A difference of two ~1.4 s process times is noisy, so a second table times the steps inside one
process: ``repeats`` fresh processes each time ``import torch``, then ``import fabric``, then
``from fabric import Fabric``, then ``Fabric(accelerator='cpu')``, each step on its own (each row is the
increment over the rows above it). The same processes report whether ``torch._dynamo`` (slow to
import, and only needed for ``torch.compile``) ended up in ``sys.modules`` -- it should not -- and
which modules Fabric added beyond ``import torch``.

How to read it
--------------
``vs import torch`` is what a user pays for Fabric at start-up; the in-process table splits it into
importing the package, importing the core and constructing a ``Fabric``. Differences of a few milliseconds are
within noise on a busy machine; compare against the spread between median and minimum. When the two
delta columns disagree, load came in bursts during the run and the paired column is the more robust.

Usage::

    python benchmarks/import_cost.py              # 7 rounds
    python benchmarks/import_cost.py --repeats 15
    python benchmarks/import_cost.py --inherit-env  # children use this environment unchanged
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

SNIPPETS: tuple[tuple[str, str], ...] = (
    ("interpreter start-up", "pass"),
    ("import torch", "import torch"),
    ("import torch, fabric", "import torch, fabric"),
    ("from fabric import Fabric", "import torch; from fabric import Fabric"),
    ("Fabric(accelerator='cpu')", "import torch; from fabric import Fabric; Fabric(accelerator='cpu')"),
    ("from fabric.trainer import Trainer", "import torch; from fabric.trainer import Trainer"),
)
BASELINE = "import torch"

# One process, each step timed on its own: fabric's increments without the noise of torch's import.
PROBE = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
before = set(sys.modules)
import fabric
t2 = time.perf_counter()
from fabric import Fabric
t3 = time.perf_counter()
Fabric(accelerator="cpu")
t4 = time.perf_counter()
from fabric.trainer import Trainer
t5 = time.perf_counter()
print(json.dumps({
    "ms": [(t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, (t4 - t3) * 1e3, (t5 - t4) * 1e3],
    "dynamo": "torch._dynamo" in sys.modules,
    "added": sorted(set(sys.modules) - before),
}))
"""
PROBE_STEPS = (
    "import torch",
    "import fabric",
    "from fabric import Fabric",
    "Fabric(accelerator='cpu')",
    "from fabric.trainer import Trainer",
)


@dataclass(frozen=True)
class Timing:
    label: str
    code: str
    median_ms: float
    min_ms: float
    paired_delta_ms: float


def child_env(pycache_prefix: Path | None) -> dict[str, str]:
    """The children's environment: ours, with a private bytecode cache unless ``pycache_prefix`` is None."""
    env = dict(os.environ)
    if pycache_prefix is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(pycache_prefix)
    return env


def run_once(code: str, env: dict[str, str]) -> float:
    """Wall time in milliseconds of one fresh ``python -c code``; raises if the snippet fails."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL)
    return (time.perf_counter() - start) * 1e3


def measure(snippets: Sequence[tuple[str, str]], repeats: int, env: dict[str, str]) -> list[Timing]:
    for _, code in snippets:  # warm-up: file cache, bytecode cache
        run_once(code, env)
    samples: dict[str, list[float]] = {label: [] for label, _ in snippets}
    for _ in range(repeats):
        for label, code in snippets:
            samples[label].append(run_once(code, env))
    baseline = samples[BASELINE]
    return [
        Timing(
            label,
            code,
            statistics.median(samples[label]),
            min(samples[label]),
            statistics.median(t - b for t, b in zip(samples[label], baseline, strict=True)),
        )
        for label, code in snippets
    ]


@dataclass(frozen=True)
class Probe:
    ms: list[float]  # one per PROBE_STEPS entry
    dynamo: bool
    added: list[str]


def run_probe(env: dict[str, str]) -> Probe:
    completed = subprocess.run(
        [sys.executable, "-c", PROBE], check=True, cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    return Probe(ms=result["ms"], dynamo=result["dynamo"], added=result["added"])


def format_probe_table(probes: Sequence[Probe]) -> str:
    lines = ["| step, timed inside one process | median ms | min ms |", "|---|---:|---:|"]
    for index, step in enumerate(PROBE_STEPS):
        values = [probe.ms[index] for probe in probes]
        lines.append(f"| `{step}` | {statistics.median(values):.1f} | {min(values):.1f} |")
    return "\n".join(lines)


def format_table(timings: Sequence[Timing]) -> str:
    baseline = next(t.median_ms for t in timings if t.label == BASELINE)
    lines = [
        "| command | median ms | min ms | vs import torch (medians) | vs import torch (paired) |",
        "|---|---:|---:|---:|---:|",
    ]
    for t in timings:
        if t.label == BASELINE:
            delta = paired = "baseline"
        else:
            delta, paired = f"{t.median_ms - baseline:+.1f} ms", f"{t.paired_delta_ms:+.1f} ms"
        lines.append(f'| `python -c "{t.code}"` | {t.median_ms:.1f} | {t.min_ms:.1f} | {delta} | {paired} |')
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Import cost of fabric on top of torch, in fresh processes.")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of each snippet (default 7)")
    parser.add_argument(
        "--inherit-env",
        action="store_true",
        help="run the children with this environment unchanged (no private bytecode cache)",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fabric-import-cost-") as tmp:
        report(args.repeats, child_env(None if args.inherit_env else Path(tmp)), private_cache=not args.inherit_env)


def report(repeats: int, env: dict[str, str], private_cache: bool) -> None:
    version = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__)"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    print(f"# Import cost | python {sys.version.split()[0]} | torch {version} | cpus {os.cpu_count()}")
    if private_cache:
        bytecode = "private bytecode cache (PYTHONPYCACHEPREFIX=<tmp>)"
    else:
        bytecode = f"inherited environment (PYTHONDONTWRITEBYTECODE={env.get('PYTHONDONTWRITEBYTECODE', '<unset>')})"
    print(f"# {repeats} interleaved rounds of fresh processes after one warm-up run each; {bytecode}\n")

    print(format_table(measure(SNIPPETS, repeats, env)))

    probes = [run_probe(env) for _ in range(repeats)]
    print()
    print(format_probe_table(probes))

    added = probes[-1].added
    third_party = sorted({name.split(".")[0] for name in added} - {"fabric", "torch"})
    dynamo_runs = sum(probe.dynamo for probe in probes)
    dynamo = f"yes in {dynamo_runs} of {len(probes)} runs (unexpected)" if dynamo_runs else "no (as expected)"
    print()
    print(f"- torch._dynamo in sys.modules after Fabric(accelerator='cpu') and the Trainer import: {dynamo}")
    print(
        f"- modules added beyond `import torch`: {len(added)} "
        f"({sum(name.split('.')[0] == 'fabric' for name in added)} fabric, "
        f"{sum(name.split('.')[0] == 'torch' for name in added)} torch, "
        f"other top-level packages: {', '.join(third_party) or 'none'})"
    )


if __name__ == "__main__":
    main()
