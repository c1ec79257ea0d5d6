"""Under ``torchrun --max-restarts``, a killed rank restarts the job, the Trainer autoresumes from its latest
checkpoint, and the end is bit-identical to an uninterrupted run (each attempt joins torchrun's store
under its own prefix, so no stale address of the previous attempt is read)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fabric.plugins.environments import find_free_port

#: Slow: torchrun restarting a killed job (`bash scripts/test.sh --end-to-end`; CI runs it).
pytestmark = pytest.mark.end_to_end

SCRIPT = str(Path(__file__).parents[2] / "scripts" / "trainer_torchrun_restart.py")


def _torchrun(out_dir: Path, kill_at: int) -> subprocess.CompletedProcess[str]:
    out_dir.mkdir()
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
    environment = {key: value for key, value in os.environ.items() if key not in launcher}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1",
        "--monitor-interval=0.1", f"--master_port={find_free_port()}", SCRIPT, str(out_dir), str(kill_at),
    ]  # fmt: skip
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=240, check=False)


def test_a_rank_killed_under_torchrun_restarts_and_ends_bit_exact(tmp_path: Path) -> None:
    straight = _torchrun(tmp_path / "straight", kill_at=0)
    assert straight.returncode == 0, straight.stderr[-3000:]
    restarted = _torchrun(tmp_path / "restarted", kill_at=5)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    for rank in range(2):
        reference = torch.load(tmp_path / "straight" / f"final-rank{rank}.pt", weights_only=True)
        result = torch.load(tmp_path / "restarted" / f"final-rank{rank}.pt", weights_only=True)
        assert (reference["attempt"], result["attempt"]) == (0, 1)  # the second run really was restarted
        assert result["resumed_at"] == 4  # from the checkpoint of batch 4, saved before rank 1 died at 5
        assert all(torch.equal(a, b) for a, b in zip(reference["params"], result["params"], strict=True))
