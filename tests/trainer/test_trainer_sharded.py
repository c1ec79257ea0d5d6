"""The Trainer on FSDP and DeepSpeed (2 CPU ranks): trains, saves sharded checkpoints, resumes exactly."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

SCRIPT = Path(__file__).parents[1] / "scripts" / "trainer_sharded.py"


def _train(strategy: str, folder: Path, duration: str, out: Path) -> dict[str, Any]:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), strategy, str(folder), duration, str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize(
    "strategy",
    [
        "fsdp",
        pytest.param(
            "deepspeed_stage_2",
            marks=pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed"),
        ),
    ],
)
def test_sharded_training_resumes_bit_identically(strategy: str, tmp_path: Path) -> None:
    straight = _train(strategy, tmp_path / "straight", "4ep", tmp_path / "straight.pt")
    first = _train(strategy, tmp_path / "interrupted", "2ep", tmp_path / "first.pt")
    resumed = _train(strategy, tmp_path / "interrupted", "4ep", tmp_path / "resumed.pt")
    assert (straight["batch"], first["batch"], resumed["started_at"], resumed["batch"]) == (16, 8, 8, 16)
    for ours, reference in zip(resumed["weights"], straight["weights"], strict=True):
        assert torch.equal(ours, reference)
    assert not all(torch.equal(a, b) for a, b in zip(first["weights"], straight["weights"], strict=True))
