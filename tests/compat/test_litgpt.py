"""litgpt 0.5.13, unchanged, through the Lightning drop-in mode (``python -m fabric.compat.lightning -m litgpt ...``),
with Lightning 2.6.6 installed beside it, in the environment ``bash scripts/litgpt_env.sh`` makes (``.venv-litgpt``,
or the interpreter ``FABRIC_LITGPT_PYTHON`` names). Without it these skip; under ``CI=true`` they fail.

A tiny random-initialised GPT (2 layers, 32 wide, vocabulary 128) pretrains on random tokens of the tests' own
(``litgpt_data.RandomTokens``). Measured once with real Lightning Fabric 2.6.6 in the same environment (``python -m
litgpt pretrain`` with the same arguments, 1 process): train loss 5.173 at iter 8, 4.966 at iter 32, 4.745 at iter 64,
final validation loss 5.039; this project gave the same four numbers. On 2 processes litgpt picks FSDP, which
Lightning refuses on a CPU ("FSDP is only available on GPU"); here: final validation loss 5.059.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]
PYTHON = Path(os.environ.get("FABRIC_LITGPT_PYTHON", ROOT / ".venv-litgpt" / "bin" / "python"))
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
TINY = {"name": "tiny", "block_size": 32, "vocab_size": 128, "padded_vocab_size": 128, "n_layer": 2, "n_head": 2,
        "n_embd": 32}  # fmt: skip

if not PYTHON.exists():
    if os.environ.get("CI") == "true":
        pytest.fail(f"litgpt's environment {PYTHON} is missing: bash scripts/litgpt_env.sh", pytrace=False)
    pytest.skip("litgpt's environment is optional here: bash scripts/litgpt_env.sh makes it", allow_module_level=True)

pytestmark = pytest.mark.end_to_end


def _pretrain(out: Path, devices: int) -> subprocess.CompletedProcess[str]:
    arguments = [
        "pretrain", "pythia-14m", "--model_config", json.dumps(TINY), "--data", "litgpt_data.RandomTokens",
        "--train.max_tokens", "4096", "--train.global_batch_size", "8", "--train.micro_batch_size", "4",
        "--train.max_seq_length", "16", "--train.log_interval", "1", "--train.save_interval", "4",
        "--eval.interval", "4", "--eval.max_iters", "2", "--logger_name", "csv", "--precision", "32-true",
        "--devices", str(devices), "--out_dir", str(out),
    ]  # fmt: skip
    environment = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    environment |= {"PYTHONPATH": str(Path(__file__).parent), "CUDA_VISIBLE_DEVICES": ""}
    command = [str(PYTHON), "-m", "fabric.compat.lightning", "-m", "litgpt", *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment, check=False)


def _train_loss(log: str, iteration: int) -> float:
    found = re.search(rf"\| iter {iteration} step \d+ \| loss train: ([0-9.]+)", log)
    assert found is not None, log[-3000:]
    return float(found.group(1))


def _final_validation_loss(log: str) -> float:
    found = re.search(r"Final evaluation \| val loss: ([0-9.]+)", log)
    assert found is not None, log[-3000:]
    return float(found.group(1))


def test_litgpt_pretrain_on_one_process_trains_as_under_lightning_and_saves_its_state(tmp_path: Path) -> None:
    """It crashed at its first save: ``fabric.save`` of the loader ``setup_dataloaders`` returned."""
    run = _pretrain(tmp_path, devices=1)
    assert run.returncode == 0, run.stderr[-3000:]
    log = run.stdout + run.stderr
    assert [_train_loss(log, iteration) for iteration in (8, 32, 64)] == pytest.approx([5.173, 4.966, 4.745], abs=0.01)
    assert _final_validation_loss(log) == pytest.approx(5.039, abs=0.01)
    state = torch.load(tmp_path / "step-00000032" / "lit_model.pth", weights_only=False)
    assert {"model", "optimizer", "train_dataloader", "iter_num", "step_count"} <= set(state)
    assert state["iter_num"] == 64 and state["step_count"] == 32
    metrics = (next(tmp_path.glob("logs/csv/version_*/metrics.csv"))).read_text().splitlines()
    assert metrics[0].startswith("step,loss,iter") and len(metrics) > 32


def test_litgpt_pretrain_on_two_processes_runs_on_fsdp(tmp_path: Path) -> None:
    """It exited 1; Lightning refuses FSDP on a CPU."""
    run = _pretrain(tmp_path, devices=2)
    assert run.returncode == 0, run.stderr[-3000:]
    assert _final_validation_loss(run.stdout + run.stderr) == pytest.approx(5.059, abs=0.01)
    assert (tmp_path / "final" / "lit_model.pth").exists()
