"""MLFlowLogger: a Trainer run written to a local MLflow store and read back through MLflow's client."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

mlflow = pytest.importorskip("mlflow")

from mlflow_server import OutageProxy  # noqa: E402
from tiny_models import Regressor, SigtermAtBatch  # noqa: E402

from fabric.trainer import Trainer  # noqa: E402
from fabric.trainer.checkpoint.preemption import PREEMPTED_EXIT_CODE  # noqa: E402
from fabric.trainer.core.callback import Callback  # noqa: E402
from fabric.trainer.loggers import InMemoryLogger  # noqa: E402
from fabric.trainer.loggers.mlflow_logger import MLFlowLogger  # noqa: E402


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A local file store (MLflow 3 wants this opt-in for file stores)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return f"file:{tmp_path / 'mlruns'}"


@pytest.fixture(params=["file", "sqlite"])
def any_store(request: pytest.FixtureRequest, store: str, tmp_path: Path) -> str:
    """The file store, or the README's ``sqlite:`` store (needs SQLAlchemy and Alembic, in ``[test]``)."""
    return store if request.param == "file" else f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_a_trainer_run_reads_back_with_params_metrics_steps_and_tags(any_store: str) -> None:
    store = any_store
    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)
    model = Regressor()
    memory = InMemoryLogger()
    logger = MLFlowLogger(experiment_name="regression", tracking_uri=store, tags={"team": "fabric"}, flush_interval=2)
    trainer = Trainer(
        model=model,
        train_dataloader=loader,
        eval_dataloader=loader,
        max_duration="2ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
        loggers=[logger, memory],
        run_name="linear-1",
        progress_bar=False,
        accelerator="cpu",
        seed=0,
    )
    trainer.logger.log_hyperparameters({"lr": 0.05, "model": {"width": 4}})
    trainer.fit()
    trainer.close()

    client = mlflow.tracking.MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("regression")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == logger.run_id
    assert run.info.run_name == "linear-1" and run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.05", "model/width": "4"}
    assert run.data.tags["team"] == "fabric"
    for name in ("loss/train/total", "metrics/eval/mae"):
        history = sorted((metric.step, metric.value) for metric in client.get_metric_history(run.info.run_id, name))
        assert history == [(step, pytest.approx(value)) for step, value in memory.data[name]], name
    assert [step for step, _ in memory.data["loss/train/total"]] == [1, 2, 3, 4, 5, 6]
    assert [step for step, _ in memory.data["metrics/eval/mae"]] == [3, 6]


def test_a_second_trainer_adds_a_run_to_the_same_experiment(store: str) -> None:
    for name in ("first", "second"):
        logger = MLFlowLogger(experiment_name="shared", tracking_uri=store, run_name=name)
        logger.log_metrics({"value": 1.0}, step=0)
        logger.close()
    client = mlflow.tracking.MlflowClient(tracking_uri=store)
    runs = client.search_runs([client.get_experiment_by_name("shared").experiment_id])
    assert sorted(run.info.run_name for run in runs) == ["first", "second"]
    assert all(run.data.metrics == {"value": 1.0} for run in runs)


def test_only_rank_zero_logs_and_bad_options_fail_at_construction() -> None:
    assert MLFlowLogger.all_ranks is False
    with pytest.raises(ValueError, match="flush_interval must be a whole number of batches, at least 1; got 0"):
        MLFlowLogger(flush_interval=0)
    with pytest.raises(ValueError, match="experiment_name='' must be a non-empty string"):
        MLFlowLogger(experiment_name="")


class FailsAtBatch3(Regressor):
    def forward(self, batch: Any) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 3:
            raise RuntimeError("the model fails on purpose")
        return super().forward(batch)


def test_a_run_whose_fit_raises_ends_failed_with_what_it_logged_before(store: str) -> None:
    logger = MLFlowLogger(experiment_name="crash", tracking_uri=store, flush_interval=100)
    trainer = _one_epoch_trainer(FailsAtBatch3(), logger)
    with pytest.raises(RuntimeError, match="the model fails on purpose"):
        trainer.fit()
    trainer.close()  # closing afterwards does not turn the failed run into a finished one

    client = mlflow.tracking.MlflowClient(tracking_uri=store)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FAILED"
    history = client.get_metric_history(run.info.run_id, "loss/train/total")
    assert [metric.step for metric in history] == [1, 2]  # buffered values were written before the run ended


def test_a_preempted_run_ends_killed(store: str, tmp_path: Path) -> None:
    """The Trainer closed the loggers before raising its preemption exit, so the run ended FINISHED."""
    logger = MLFlowLogger(experiment_name="preempted", tracking_uri=store)
    trainer = _one_epoch_trainer(Regressor(), logger, callbacks=SigtermAtBatch(2), save_folder=str(tmp_path / "ckpt"))
    with pytest.raises(SystemExit) as preempted:
        trainer.fit()
    assert preempted.value.code == PREEMPTED_EXIT_CODE
    trainer.close()
    assert mlflow.tracking.MlflowClient(tracking_uri=store).get_run(logger.run_id).info.status == "KILLED"


class StoreOutage(Callback):
    """Makes the file store unwritable from the end of batch ``fail_at`` (its folder swapped for a plain file) until
    the end of batch ``recover_at``, once the logger's writer has tried what it was given in between."""

    def __init__(self, folder: Path, logger: MLFlowLogger, fail_at: int, recover_at: int) -> None:
        self.folder, self.logger, self.fail_at, self.recover_at = folder, logger, fail_at, recover_at

    def batch_end(self, state: Any, logger: Any) -> None:
        aside = self.folder.with_name("mlruns-aside")
        if int(state.timestamp.batch) == self.fail_at:
            self.folder.rename(aside)
            self.folder.write_text("not a folder")
        elif int(state.timestamp.batch) == self.recover_at:
            self.logger.flush(wait=True)  # the writer has met the outage
            self.folder.unlink()
            aside.rename(self.folder)


def test_a_tracking_store_that_fails_mid_run_warns_once_and_loses_nothing(store: str, tmp_path: Path) -> None:
    """A store that failed at batch 3 made fit() raise at the next flush (and a secondary error hid the first)."""
    logger = MLFlowLogger(experiment_name="outage", tracking_uri=store, flush_interval=1)
    outage = StoreOutage(tmp_path / "mlruns", logger, fail_at=3, recover_at=6)
    trainer = _one_epoch_trainer(Regressor(), logger, samples=32, callbacks=outage)
    with pytest.warns(UserWarning, match="MLFlowLogger could not write metrics to the tracking store") as caught:
        trainer.fit()
    trainer.close()
    assert len([w for w in caught if "MLFlowLogger" in str(w.message)]) == 1
    client = mlflow.tracking.MlflowClient(tracking_uri=store)
    assert client.get_run(logger.run_id).info.status == "FINISHED"
    history = client.get_metric_history(logger.run_id, "loss/train/total")
    assert sorted(metric.step for metric in history) == list(range(1, 9))  # the outage's values were written later


class OutageFrom(Callback):
    """Starts the proxy's outage at the end of batch ``batch``."""

    def __init__(self, proxy: OutageProxy, batch: int) -> None:
        self.proxy, self.batch = proxy, batch

    def batch_end(self, state: Any, logger: Any) -> None:
        if int(state.timestamp.batch) == self.batch:
            self.proxy.hold()


def test_a_tracking_server_that_stops_answering_does_not_hold_training_and_loses_nothing(mlflow_server: str) -> None:
    """The logger wrote on the training thread: a server answering 503 for 45 s stopped training for 62 s, and one
    that answers nothing held it until MLflow's request timeout. The outage here lasts until fit() has returned."""
    proxy = OutageProxy(mlflow_server)
    logger = MLFlowLogger(experiment_name="server-outage", tracking_uri=proxy.url, flush_interval=1)
    trainer = _one_epoch_trainer(Regressor(), logger, samples=32, callbacks=OutageFrom(proxy, batch=2))
    fitting = threading.Thread(target=trainer.fit, daemon=True)
    fitting.start()
    fitting.join(timeout=120)
    finished_during_the_outage = not fitting.is_alive()
    writer_met_the_outage = proxy.wait_for_held(timeout=60)  # the writer's next request, held
    proxy.release()
    fitting.join()
    trainer.close()  # sends what the outage kept back, and waits for it
    proxy.close()
    assert finished_during_the_outage, "training waited for the tracking server"
    assert writer_met_the_outage
    client = mlflow.tracking.MlflowClient(tracking_uri=mlflow_server)
    assert client.get_run(logger.run_id).info.status == "FINISHED"
    history = client.get_metric_history(logger.run_id, "loss/train/total")
    assert sorted(metric.step for metric in history) == list(range(1, 9))


def _one_epoch_trainer(model: nn.Module, logger: MLFlowLogger, samples: int = 16, **options: Any) -> Trainer:
    """A Trainer over one epoch of ``samples`` fixed regression samples in batches of 4, logging to ``logger``."""
    x = torch.randn(samples, 4, generator=torch.Generator().manual_seed(0))
    return Trainer(
        model=model,
        train_dataloader=DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4),
        max_duration="1ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
        loggers=logger,
        progress_bar=False,
        accelerator="cpu",
        **options,
    )


def test_a_table_is_the_runs_json_artifact_in_mlflows_table_format(store: str, tmp_path: Path) -> None:
    """``logger.log_table`` (the Generate callback's generations) becomes the run's artifact ``<name>.json``."""
    logger = MLFlowLogger(experiment_name="tables", tracking_uri=store)
    logger.log_table(["prompt", "generation"], [["w1", "w2 w3"], ["w4", "w5"]], "generations", step=3)
    logger.close()
    client = mlflow.tracking.MlflowClient(tracking_uri=store)
    path = client.download_artifacts(logger.run_id, "generations.json", str(tmp_path))
    table = json.loads(Path(path).read_text())
    assert table["columns"] == ["prompt", "generation"] and table["data"] == [["w1", "w2 w3"], ["w4", "w5"]]
