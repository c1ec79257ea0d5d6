"""What the DDP benchmarks share: the two jobs, how to start them, and how to read what they printed.

Used by ``ddp.py`` and ``ddp_exit_codes.py`` (imported as a sibling module: run those as scripts).
"""

from __future__ import annotations

import os
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

JOBS_DIR = Path(__file__).resolve().parent / "ddp_jobs"
RAW_JOB = JOBS_DIR / "raw_ddp_job.py"
FABRIC_JOB = JOBS_DIR / "fabric_ddp_job.py"
#: Rank 0 of each job prints its report as one JSON line after this prefix.
RESULT_PREFIX = "DDP_JOB_RESULT "
#: Lines worth showing from a failed run's stderr besides its end.
KEY_LINES = re.compile(r"terminate called|exitcode|closing signal|fabric:|Error|error:|Killed|Abort")


@dataclass(frozen=True)
class Variant:
    """One way of running one job: which script, launched how."""

    key: str
    description: str
    script: Path
    torchrun: bool
    extra_args: tuple[str, ...] = ()


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def command(variant: Variant, steps: int, warmup: int) -> list[str]:
    """The command line of one run: ``python job.py`` or torchrun on a free port."""
    job = [str(variant.script), "--steps", str(steps), "--warmup", str(warmup), *variant.extra_args]
    if not variant.torchrun:
        return [sys.executable, *job]
    launcher = ["-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2"]
    return [sys.executable, *launcher, "--master_addr=127.0.0.1", f"--master_port={find_free_port()}", *job]


def child_env(pycache_prefix: Path | None) -> dict[str, str]:
    """The jobs' environment: ours, with a private bytecode cache unless ``pycache_prefix`` is None."""
    env = dict(os.environ)
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS"):
        env.pop(name, None)  # a clean start: no rank variables or thread settings leak into the jobs
    if pycache_prefix is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(pycache_prefix)
    return env


def excerpt(stderr: str, tail: int = 20) -> str:
    """The lines of a failed job's stderr that say what happened, then its end."""
    lines = stderr.strip().splitlines()
    head = [line for line in lines[:-tail] if KEY_LINES.search(line)]
    return "\n".join([*head, "[...]", *lines[-tail:]] if head else lines[-tail:])


def load_average() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())
