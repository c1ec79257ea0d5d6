"""Algorithms on 2 real DDP ranks (3 process launches in all): GradientClipping clips the all-reduced gradients, so
with EMA, LabelSmoothing and LayerFreezing the ranks stay identical and match one process on the full batch; with
fp16 autocast + GradScaler and MixUp the ranks agree, the clipped norm is the threshold, and the model learns."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "scripts" / "trainer_ddp_algorithms.py"
THRESHOLD = 0.3  # as in the script
BATCHES = 16  # 4 epochs of 64 samples in global batches of 16


def _train(out_dir: Path, devices: int, mode: str) -> list[dict[str, Any]]:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(out_dir), str(devices), mode],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(path, weights_only=True) for path in sorted(out_dir.glob("rank*.pt"))]
    assert [rank["world_size"] for rank in ranks] == [devices] * devices
    assert all(rank["batches"] == BATCHES for rank in ranks)
    return ranks


def _assert_ranks_identical(ranks: list[dict[str, Any]]) -> None:
    first, second = ranks
    for key in ("params", "ema"):
        for ours, theirs in zip(first[key], second[key], strict=True):
            assert torch.equal(ours, theirs), f"{key} differ across ranks"
    assert first["norms"] == second["norms"]


@pytest.fixture(scope="module")
def mixed_precision_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _train(tmp_path_factory.mktemp("mixed"), 2, "mixed")


def test_clipping_ema_label_smoothing_and_layer_freezing_on_two_ranks_match_one_process(tmp_path: Path) -> None:
    (reference,) = _train(tmp_path / "one", 1, "exact")
    ranks = _train(tmp_path / "two", 2, "exact")
    _assert_ranks_identical(ranks)
    for key in ("params", "ema"):
        for ours, theirs in zip(ranks[0][key], reference[key], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # clipping acted on the all-reduced (full-batch) gradient: the same norms as one process, capped at THRESHOLD
    assert ranks[0]["norms"] == pytest.approx(reference["norms"], rel=1e-4)
    assert max(ranks[0]["norms"]) == pytest.approx(THRESHOLD, rel=1e-5)
    assert sum(norm == pytest.approx(THRESHOLD, rel=1e-5) for norm in reference["norms"]) >= BATCHES // 4
    assert ranks[0]["frozen"] == reference["frozen"] and any(reference["frozen"]) and not all(reference["frozen"])
    assert ranks[0]["loss_after"] < 0.6 * ranks[0]["loss_before"]


def test_mixup_and_clipping_under_a_grad_scaler_on_two_ranks_agree(mixed_precision_ranks: list[dict[str, Any]]) -> None:
    _assert_ranks_identical(mixed_precision_ranks)
    norms = mixed_precision_ranks[0]["norms"]
    finite = [norm for norm in norms if norm == norm]  # a step whose scaled gradients overflowed has NaN here
    assert len(finite) >= BATCHES // 2
    assert all(norm == pytest.approx(THRESHOLD, rel=1e-3) or norm < THRESHOLD for norm in finite)


def test_mixup_and_clipping_under_a_grad_scaler_on_two_ranks_learn(mixed_precision_ranks: list[dict[str, Any]]) -> None:
    rank = mixed_precision_ranks[0]
    assert rank["loss_after"] < 0.8 * rank["loss_before"]
