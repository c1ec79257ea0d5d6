"""Fixtures shared by the Trainer's multi-process tests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

SHARDED_SCRIPT = Path(__file__).parents[1] / "scripts" / "trainer_sharded.py"
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="session")
def sharded_reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Any]]:
    """The uninterrupted 4-epoch run of ``tests/scripts/trainer_sharded.py`` on 2 ranks with a strategy, local
    checkpoints: the reference every resume test compares with. It does not depend on the test, so each strategy's
    runs once per session."""
    runs: dict[str, dict[str, Any]] = {}

    def run(strategy: str) -> dict[str, Any]:
        if strategy not in runs:
            out = tmp_path_factory.mktemp(f"straight-{strategy}")
            environment = {key: value for key, value in os.environ.items() if key not in RANK_VARIABLES}
            command = [sys.executable, str(SHARDED_SCRIPT), strategy, str(out / "local"), "4ep", str(out / "run.pt")]
            result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=environment)
            assert result.returncode == 0, result.stderr[-3000:]
            runs[strategy] = torch.load(out / "run.pt", weights_only=True)
        return runs[strategy]

    return run
