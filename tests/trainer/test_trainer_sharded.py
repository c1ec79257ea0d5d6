"""The Trainer on FSDP and DeepSpeed (2 CPU ranks): trains, saves sharded checkpoints, resumes exactly."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

#: Slow: sharded Trainer runs interrupted and resumed on real ranks (`bash scripts/test.sh --end-to-end`; CI runs it).
pytestmark = pytest.mark.end_to_end

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
def test_sharded_training_resumes_bit_identically(
    strategy: str, tmp_path: Path, sharded_reference: Callable[[str], dict[str, Any]]
) -> None:
    straight = sharded_reference(strategy)
    first = _train(strategy, tmp_path / "interrupted", "2ep", tmp_path / "first.pt")
    resumed = _train(strategy, tmp_path / "interrupted", "4ep", tmp_path / "resumed.pt")
    assert (straight["batch"], first["batch"], resumed["started_at"], resumed["batch"]) == (16, 8, 8, 16)
    for ours, reference in zip(resumed["weights"], straight["weights"], strict=True):
        assert torch.equal(ours, reference)
    assert not all(torch.equal(a, b) for a, b in zip(first["weights"], straight["weights"], strict=True))


def test_a_two_rank_fsdp_checkpoint_resumes_in_one_process(tmp_path: Path) -> None:
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from fabric.trainer import Trainer

    _train("fsdp", tmp_path / "run", "2ep", tmp_path / "first.pt")
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    class Regressor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, batch: Any) -> Any:
            return self.net(batch[0])

        def loss(self, outputs: Any, batch: Any) -> Any:
            return torch.nn.functional.mse_loss(outputs, batch[1])

    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    regressor = Regressor()
    with pytest.warns(UserWarning, match="saved by 2 rank\\(s\\) and this run has 1: random number generators"):
        trainer = Trainer(
            model=regressor,
            train_dataloader=DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8),
            max_duration="3ep",
            optimizers=torch.optim.Adam(regressor.parameters(), lr=1e-2),
            load_path=str(tmp_path / "run" / "ep2-ba8-rank0.pt"),
            progress_bar=False,
            accelerator="cpu",
        )
    first = torch.load(tmp_path / "first.pt", weights_only=True)
    for ours, saved in zip(trainer.state.model.parameters(), first["weights"], strict=True):
        assert torch.equal(ours.detach(), saved)  # the shards were put back together
    assert (int(trainer.state.timestamp.batch), int(trainer.state.timestamp.sample)) == (8, 128)
    trainer.fit()  # one more epoch: 8 batches of 8 samples on one process
    assert (int(trainer.state.timestamp.batch), int(trainer.state.timestamp.sample)) == (16, 192)
