"""Resume on 2 real DDP ranks: bit-identical to an uninterrupted 2-rank run; a 2-rank checkpoint loads on 1 rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

#: Slow: a 2-rank Trainer run resumed bit-identically (`bash scripts/test.sh --end-to-end`; CI runs it).
pytestmark = pytest.mark.end_to_end

SCRIPT = Path(__file__).parents[2] / "scripts" / "trainer_ddp_resume.py"


def _run(out_dir: Path, devices: int, mode: str) -> list[dict]:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(out_dir), str(devices), mode],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [torch.load(out_dir / f"{mode}-{devices}-rank{rank}.pt", weights_only=True) for rank in range(devices)]


def test_two_rank_resume_is_bit_identical_and_loads_on_one_rank(tmp_path: Path) -> None:
    full = _run(tmp_path, 2, "full")
    first = _run(tmp_path, 2, "first")
    assert [rank["batch"] for rank in first] == [4, 4]  # stopped mid-epoch (6 batches an epoch)
    resumed = _run(tmp_path, 2, "resume")
    assert [rank["resumed_at"] for rank in resumed] == [(4, 64), (4, 64)]
    for rank in range(2):
        for ours, reference in zip(resumed[rank]["params"], full[rank]["params"], strict=True):
            assert torch.equal(ours, reference)

    (elastic,) = _run(tmp_path, 1, "resume")  # the 2-rank checkpoint on one process
    assert elastic["resumed_at"] == (4, 64)  # the clock and the global sample count carry over
    assert elastic["batch"] == 10 and elastic["sample"] == 64 + 6 * 8
    for ours, theirs in zip(elastic["params"], first[0]["params"], strict=True):
        assert ours.shape == theirs.shape and not torch.equal(ours, theirs)  # it kept training from there
