"""How reliably a job restarts under ``torchrun --max-restarts=1`` after one rank is SIGKILLed.

Two jobs, each run N times (interleaved):

- plain torch DDP joining with ``init_process_group("gloo")`` (``ddp_jobs/raw_restart_job.py``);
- Fabric's Trainer with ``autoresume=True`` (``tests/scripts/trainer_torchrun_restart.py``), which
  succeeds only if the restarted attempt resumes and ends bit-identical to an uninterrupted run.

A run that exits non-zero or takes longer than ``--timeout`` seconds counts as a failure.

    python benchmarks/torchrun_restarts.py --runs 20
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from ddp_launching import JOBS_DIR, child_env, find_free_port, load_average

RAW_JOB = JOBS_DIR / "raw_restart_job.py"
TRAINER_JOB = Path(__file__).resolve().parent.parent / "tests" / "scripts" / "trainer_torchrun_restart.py"


def _torchrun(script: Path, args: list[str], timeout: float) -> bool:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1",
        "--monitor-interval=0.1", f"--master_port={find_free_port()}", str(script), *args,
    ]  # fmt: skip
    job = subprocess.Popen(
        command, env=child_env(None), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        return job.wait(timeout=timeout) == 0
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)  # torchrun and its workers: a hung rank must not outlive the run
        job.wait()
        return False


def _final_params(out_dir: Path) -> list[list[torch.Tensor]]:
    return [torch.load(out_dir / f"final-rank{rank}.pt", weights_only=True)["params"] for rank in range(2)]


def _trainer_restarts(work: Path, index: int, reference: list[list[torch.Tensor]], timeout: float) -> bool:
    out_dir = work / f"run{index}"
    out_dir.mkdir()
    if not _torchrun(TRAINER_JOB, [str(out_dir), "5"], timeout):
        return False
    params = _final_params(out_dir)
    return all(torch.equal(a, b) for ranks in zip(reference, params, strict=True) for a, b in zip(*ranks, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="runs of each job (default 20)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds before a run counts as hung")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        (work / "reference").mkdir()
        if not _torchrun(TRAINER_JOB, [str(work / "reference"), "0"], args.timeout):
            raise SystemExit("the uninterrupted Trainer run failed")
        reference = _final_params(work / "reference")
        raw = trainer = 0
        for index in range(args.runs):
            raw += _torchrun(RAW_JOB, [], args.timeout)
            trainer += _trainer_restarts(work, index, reference, args.timeout)
            print(f"after {index + 1} runs: plain torch {raw}, Fabric Trainer {trainer}", file=sys.stderr, flush=True)
    print(f"# torchrun --max-restarts=1, one rank SIGKILLed | torch {torch.__version__} | load {load_average()}")
    print("| job | restarts that succeeded |")
    print("|---|---:|")
    print(f"| plain torch DDP, init_process_group(env://) | {raw}/{args.runs} |")
    print(f"| Fabric Trainer, autoresume, bit-exact with an uninterrupted run | {trainer}/{args.runs} |")


if __name__ == "__main__":
    main()
