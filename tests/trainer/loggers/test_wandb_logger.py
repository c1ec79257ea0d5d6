"""WandBLogger: an offline W&B run written by the Trainer, read back from the run's record file."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

wandb = pytest.importorskip("wandb")
from tiny_models import Regressor, SigtermAtBatch  # noqa: E402
from wandb.proto import wandb_internal_pb2  # noqa: E402

from fabric.trainer import Trainer  # noqa: E402
from fabric.trainer.checkpoint.preemption import PREEMPTED_EXIT_CODE  # noqa: E402
from fabric.trainer.core.callback import Callback  # noqa: E402
from fabric.trainer.loggers import InMemoryLogger  # noqa: E402
from fabric.trainer.loggers.wandb_logger import WandBLogger  # noqa: E402


def _records(path: Path) -> Iterator[Any]:
    """The protobuf records of a ``.wandb`` file: a ``:W&B`` header, then LevelDB-log framed records."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, position, chunks = 32768, 7, []
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0 and length == 0:
            position += left
            continue
        chunks.append(data[position + 7 : position + 7 + length])
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST: a record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Keep W&B offline, quiet and inside tmp_path (its config, cache and artifact staging too)."""
    for variable in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return {"mode": "offline", "dir": str(tmp_path)}


def test_an_offline_trainer_run_holds_name_config_metrics_with_steps_and_checkpoint_artifacts(
    tmp_path: Path, offline: dict[str, Any]
) -> None:
    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)
    model = Regressor()
    memory = InMemoryLogger()
    logger = WandBLogger(project="regression", tags=["tiny"], log_artifacts=True, init_kwargs=offline)
    trainer = Trainer(
        model=model,
        train_dataloader=loader,
        eval_dataloader=loader,
        max_duration="2ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
        loggers=[logger, memory],
        run_name="linear-1",
        save_folder=str(tmp_path / "checkpoints"),
        progress_bar=False,
        accelerator="cpu",
        seed=0,
    )
    trainer.logger.log_hyperparameters({"lr": 0.05, "model": {"width": 4}})
    trainer.fit()
    trainer.close()
    wandb.teardown()  # the run file is written asynchronously: wait until W&B's service flushed it

    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    records = list(_records(run_file))
    (run,) = [record.run for record in records if record.HasField("run")]
    assert (run.display_name, run.project, list(run.tags)) == ("linear-1", "regression", ["tiny"])
    config = {
        item.key: json.loads(item.value_json)
        for record in records
        if record.HasField("config")
        for item in record.config.update
    }
    assert config["lr"] == 0.05 and config["model"] == {"width": 4}
    history: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        if record.HasField("history"):
            # names with "/" arrive as nested keys
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for name, value in row.items():
                if not name.startswith("_"):
                    history.setdefault(name, []).append((record.history.step.num, value))
    for name in ("loss/train/total", "metrics/eval/mae"):
        assert history[name] == [(step, pytest.approx(value)) for step, value in memory.data[name]], name
    assert [step for step, _ in history["metrics/eval/mae"]] == [3, 6]

    artifacts = [record.artifact for record in records if record.HasField("artifact")]
    assert [(a.name, a.type, [alias for alias in a.aliases if alias != "latest"]) for a in artifacts] == [
        ("linear-1-checkpoint", "model", ["ep1-ba3-rank0.pt"]),
        ("linear-1-checkpoint", "model", ["ep2-ba6-rank0.pt"]),
    ]
    assert [[entry.path for entry in a.manifest.contents] for a in artifacts] == [
        ["ep1-ba3-rank0.pt"],
        ["ep2-ba6-rank0.pt"],
    ]
    (exit_record,) = [record.exit for record in records if record.HasField("exit")]
    assert exit_record.exit_code == 0


def test_without_log_artifacts_no_checkpoint_is_logged(tmp_path: Path, offline: dict[str, Any]) -> None:
    trainer = _one_batch_trainer(Regressor(), WandBLogger(name="named", init_kwargs=offline), str(tmp_path / "ckpt"))
    trainer.fit()
    records = _close_and_read(trainer, tmp_path)
    assert not [record for record in records if record.HasField("artifact")]
    assert [record.run.display_name for record in records if record.HasField("run")] == ["named"]


def test_a_run_whose_fit_raises_finishes_with_a_failing_exit_code(tmp_path: Path, offline: dict[str, Any]) -> None:
    class Fails(Regressor):
        def forward(self, batch: Any) -> torch.Tensor:
            raise RuntimeError("the model fails on purpose")

    trainer = _one_batch_trainer(Fails(), WandBLogger(name="crash", init_kwargs=offline))
    trainer.logger.log_hyperparameters({"lr": 0.05})  # the run starts with its first value
    with pytest.raises(RuntimeError, match="the model fails on purpose"):
        trainer.fit()
    (exit_record,) = [record.exit for record in _close_and_read(trainer, tmp_path) if record.HasField("exit")]
    assert exit_record.exit_code == 1


def test_a_preempted_run_finishes_with_exit_code_75(tmp_path: Path, offline: dict[str, Any]) -> None:
    """The Trainer closed the loggers before raising its preemption exit, so the run finished with exit code 0."""
    trainer = _one_batch_trainer(
        Regressor(), WandBLogger(name="preempted", init_kwargs=offline), str(tmp_path / "ckpt"), SigtermAtBatch(1)
    )
    with pytest.raises(SystemExit) as preempted:
        trainer.fit()
    assert preempted.value.code == PREEMPTED_EXIT_CODE
    (exit_record,) = [record.exit for record in _close_and_read(trainer, tmp_path) if record.HasField("exit")]
    assert exit_record.exit_code == PREEMPTED_EXIT_CODE


def _one_batch_trainer(
    model: nn.Module, logger: WandBLogger, save_folder: str | None = None, *callbacks: Callback
) -> Trainer:
    x = torch.randn(4, 4)
    return Trainer(
        model=model,
        train_dataloader=DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4),
        max_duration="1ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
        loggers=logger,
        save_folder=save_folder,
        callbacks=list(callbacks),
        progress_bar=False,
        accelerator="cpu",
    )


def _close_and_read(trainer: Trainer, tmp_path: Path) -> list[Any]:
    """Close the trainer, then the records of the one run file under ``tmp_path``."""
    trainer.close()
    wandb.teardown()  # the run file is written asynchronously: wait until W&B's service flushed it
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    return list(_records(run_file))


def test_only_rank_zero_logs_and_bad_options_fail_at_construction() -> None:
    assert WandBLogger.all_ranks is False
    with pytest.raises(ValueError, match=r"Pass \['project'\] as WandBLogger arguments, not in init_kwargs"):
        WandBLogger(init_kwargs={"project": "p"})
    with pytest.raises(TypeError, match="tags must be a list of strings, got the string 'a'"):
        WandBLogger(tags="a")


def test_a_table_is_a_wandb_table_in_the_runs_history(tmp_path: Path, offline: dict[str, Any]) -> None:
    """``logger.log_table`` (the Generate callback's generations) becomes a ``wandb.Table`` logged at its step."""
    logger = WandBLogger(project="tables", init_kwargs=offline)
    logger.log_table(["prompt", "generation"], [["w1", "w2 w3"], ["w4", "w5"]], "generations", step=3)
    logger.close()
    wandb.teardown()
    (table_file,) = tmp_path.glob("wandb/offline-run-*/files/media/table/generations_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["prompt", "generation"] and table["data"] == [["w1", "w2 w3"], ["w4", "w5"]]
