"""The README's quick start and the demo example run as documented."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_readme_quick_start_runs_and_its_checkpoint_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    readme = (ROOT / "README.md").read_text()
    quick_start = re.search(r"## Quick start\s+```python\n(.*?)```", readme, re.DOTALL)
    assert quick_start is not None
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {}
    exec(compile(quick_start.group(1), "README.md", "exec"), namespace)
    assert (tmp_path / "checkpoints" / "last.pt").is_file()
    fabric, model, optimizer = namespace["fabric"], namespace["model"], namespace["optimizer"]
    state = {"model": model, "optimizer": optimizer, "epoch": 0}
    fabric.load("checkpoints/last.pt", state)  # type: ignore[attr-defined]
    assert state["epoch"] == 4


def test_demo_prints_a_falling_loss(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_fabric.py"), "--epochs", "10", "--accelerator", "cpu"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [line.split() for line in result.stdout.splitlines() if re.match(r"\s+\d+\s+\d", line)]
    losses = [float(row[1]) for row in rows]
    assert len(losses) >= 3
    assert losses[-1] < 0.5 * losses[0]
    assert (tmp_path / "runs" / "demo" / "spiral.pt").is_file()


def test_ddp_example_trains_on_two_ranks_with_identical_replicas(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "ddp_train.py"), "--devices", "2", "--epochs", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert "2 ranks, replicas identical: True" in result.stdout
    losses = [float(line.split()[-1]) for line in result.stdout.splitlines() if line.startswith("epoch")]
    assert len(losses) == 2 and losses[1] < losses[0]
