"""``accumulate_train_batch_on_tokens=True`` (Composer's; llm-foundry's default): microbatch losses weighted by their
loss-generating tokens over every rank's batch, so one step equals a step on the mean loss over every token of the
global batch, on one process with microbatches and on two real DDP ranks whose halves hold different token counts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

SCRIPT = Path(__file__).parents[1] / "scripts" / "trainer_token_accumulation.py"
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def _train(out_dir: Path, devices: int, microbatch: int, *mode: str) -> list[dict[str, Any]]:
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    command = [sys.executable, str(SCRIPT), str(out_dir), str(devices), str(microbatch), *mode]
    job = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert job.returncode == 0, job.stderr[-3000:]
    return [torch.load(path, weights_only=True) for path in sorted(out_dir.glob("rank*.pt"))]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[torch.Tensor]:
    (result,) = _train(tmp_path_factory.mktemp("reference"), 0, 0)
    return result["params"]


def _assert_same(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("microbatch", [8, 3, 1])
def test_one_process_with_microbatches_steps_on_the_mean_over_every_token(
    tmp_path: Path, reference: list[torch.Tensor], microbatch: int
) -> None:
    (result,) = _train(tmp_path, 1, microbatch)
    _assert_same(result["params"], reference)
    assert result["tokens"] == 8 * 8  # the clock counts the "total" tokens of the dict the counter returns


def test_two_ranks_with_different_token_counts_step_on_the_mean_over_every_token(
    tmp_path: Path, reference: list[torch.Tensor]
) -> None:
    ranks = _train(tmp_path, 2, 2)
    assert len(ranks) == 2
    for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(a, b), "parameters differ across ranks"
    _assert_same(ranks[0]["params"], reference)


def test_weighting_by_samples_is_a_different_step(tmp_path: Path, reference: list[torch.Tensor]) -> None:
    """The check has teeth: the default weighting (each microbatch's share of the samples) gives other weights."""
    (result,) = _train(tmp_path, 1, 1, "samples")
    assert any(not torch.allclose(a, b, rtol=1e-3, atol=1e-4) for a, b in zip(result["params"], reference, strict=True))
