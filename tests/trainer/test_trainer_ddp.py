"""The Trainer on 2 real DDP ranks: same weights as one process on the full batch, global counts, OOM agreement."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

SCRIPT = Path(__file__).parents[1] / "scripts" / "trainer_ddp.py"


def _train(out_dir: Path, *args: str) -> list[dict[str, Any]]:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(out_dir), *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [torch.load(path, weights_only=True) for path in sorted(out_dir.glob("rank*.pt"))]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    (result,) = _train(tmp_path_factory.mktemp("single"), "1")
    return result


def _assert_same_training(ranks: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    assert [rank["world_size"] for rank in ranks] == [2, 2]
    for rank in ranks[1:]:
        for ours, theirs in zip(ranks[0]["params"], rank["params"], strict=True):
            assert torch.equal(ours, theirs), "parameters differ across ranks"
    for ours, theirs in zip(ranks[0]["params"], reference["params"], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # samples count globally: 3 epochs of 64 samples, as in the single process
    assert [(rank["samples"], rank["batches"]) for rank in ranks] == [(192, 12), (192, 12)]
    assert reference["samples"] == 192
    # Composer's idiom `state.model.module if state.is_model_ddp else state.model` finds the user's model
    assert [rank["composer_state"] for rank in ranks] == [[True, True, "cpu"]] * 2
    assert reference["composer_state"] == [True, True, "cpu"]  # one process: wrapped by Fabric all the same
    # the logged train loss is the mean over the ranks (Composer's), so the full batch's: not rank 0's half
    assert ranks[0]["logged_losses"] == ranks[1]["logged_losses"]
    assert ranks[0]["logged_losses"] == pytest.approx(reference["logged_losses"], rel=1e-4)
    # eval metrics are reduced over ranks: both see the value of the whole eval set
    assert ranks[0]["mae"] == ranks[1]["mae"] == pytest.approx(reference["mae"], rel=1e-5)


def test_trainer_on_two_ranks_matches_one_process_on_the_full_batch(tmp_path: Path, one_process: dict) -> None:
    _assert_same_training(_train(tmp_path, "2"), one_process)


def test_auto_microbatching_agrees_across_ranks_when_only_one_runs_out_of_memory(
    tmp_path: Path, one_process: dict
) -> None:
    ranks = _train(tmp_path, "2", "auto_oom")
    assert [rank["microbatch"] for rank in ranks] == [4, 4]  # rank 1 failed at 8; both halved together
    # Eval: rank 1 alone ran out of memory above 2 samples. Rank 0's forwards of 8 were thrown away and run again,
    # so a callback at EVAL_AFTER_FORWARD counted 48 samples of its 32 in the first evaluation. Now no forward that
    # produced outputs is discarded: 3 evaluations of each rank's 32 samples, and the metric is unchanged.
    assert [rank["eval_forward_samples"] for rank in ranks] == [96, 96]
    assert [rank["eval_microbatch"] for rank in ranks] == [2, 2]
    _assert_same_training(ranks, one_process)


def test_lbfgs_on_two_ranks_matches_one_process_on_the_full_batch(tmp_path: Path) -> None:
    """The closure returns the loss averaged over ranks, so both ranks' line searches take the same steps
    (with each rank's own loss, rank 1 made a different number of closure calls and the job died)."""
    (reference,) = _train(tmp_path / "single", "1", "lbfgs")
    ranks = _train(tmp_path / "ddp", "2", "lbfgs")
    for ours, theirs in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(ours, theirs), "parameters differ across ranks"
    # LBFGS amplifies the different summation order of the averaged gradients (about 2e-4 after 12 steps)
    for ours, theirs in zip(ranks[0]["params"], reference["params"], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-2, atol=5e-4)
    assert ranks[0]["mae"] == pytest.approx(reference["mae"], rel=1e-3)


def test_one_loss_per_optimizer_on_two_ranks_matches_one_process(tmp_path: Path) -> None:
    script = SCRIPT.parent / "trainer_gan_ddp.py"
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    results = []
    for devices in (1, 2):
        out = tmp_path / f"gan{devices}.pt"
        run = subprocess.run(
            [sys.executable, str(script), str(devices), str(out)], capture_output=True, text=True, timeout=300, env=env
        )
        assert run.returncode == 0, run.stderr[-3000:]
        results.append(torch.load(out, weights_only=True))
    one, two = results
    assert two["ranks_identical"]
    torch.testing.assert_close(two["params"], one["params"], rtol=1e-5, atol=1e-6)
