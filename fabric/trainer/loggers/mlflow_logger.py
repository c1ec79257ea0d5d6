"""``MLFlowLogger``: the Trainer's metrics, hyperparameters and tags in an MLflow experiment run.

Needs the ``mlflow`` extra (``pip install -e ".[mlflow]"`` from the checkout, which brings ``mlflow-skinny``
with SQLAlchemy and Alembic for ``sqlite:`` tracking URIs); ``mlflow`` is imported when the first
value is logged, not before. Only global rank 0 logs::

    logger = MLFlowLogger(experiment_name="mnist", tracking_uri="sqlite:///mlflow.db", tags={"team": "vision"})
    trainer = Trainer(..., loggers=logger)
    trainer.logger.log_hyperparameters({"lr": 0.1})
    trainer.fit()
    trainer.close()   # writes what is buffered and ends the run as FINISHED (FAILED if fit() raised)

The run is named after the Trainer's ``run_name`` unless ``run_name`` is given. Metrics keep the
Trainer's names (``loss/train/total``, ``metrics/eval/accuracy``) and the global batch count as their
step; they are buffered and handed every ``flush_interval`` batches to a writer thread, which sends them with
``log_batch`` (:class:`~fabric.trainer.loggers.background_writer.BackgroundWriter`): a tracking server that is slow,
failing or not answering never holds training (nor, on DDP, the ranks that wait for rank 0), and what it has not
taken is kept and sent again at the next flush. Closing sends the rest and waits for it. Hyperparameters become
MLflow params (nested dicts flattened to ``a/b``; values as text), written at once.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from fabric.trainer.loggers.background_writer import BackgroundWriter
from fabric.trainer.loggers.destination import LoggerDestination
from fabric.utilities.lazy import install_hint
from fabric.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State


#: Metric values kept while the tracking store fails; past this the oldest are dropped (and counted).
MAX_BUFFERED = 1_000_000


class MLFlowLogger(LoggerDestination):
    """Logs to an MLflow tracking store: ``tracking_uri`` (default: ``MLFLOW_TRACKING_URI``, else MLflow's)."""

    def __init__(
        self,
        experiment_name: str | None = None,
        run_name: str | None = None,
        tracking_uri: str | None = None,
        tags: Mapping[str, str] | None = None,
        flush_interval: int = 10,
    ) -> None:
        if isinstance(flush_interval, bool) or not isinstance(flush_interval, int) or flush_interval < 1:
            raise ValueError(f"flush_interval must be a whole number of batches, at least 1; got {flush_interval!r}.")
        for name, value in {"experiment_name": experiment_name, "run_name": run_name}.items():
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name}={value!r} must be a non-empty string or None.")
        self.experiment_name = experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "fabric"
        self.run_name = run_name
        self.tracking_uri = tracking_uri
        self.tags = {str(key): str(value) for key, value in (tags or {}).items()}
        self.flush_interval = flush_interval
        #: The MLflow run this logger writes (or, after close, wrote) to; ``None`` before the first value.
        self.run_id: str | None = None
        self._running = False
        self._client: Any = None
        self._writer: BackgroundWriter[Any] | None = None  # the run's metric writer, from its first value to close
        self._warned = False

    @override
    def init(self, state: State, logger: Logger) -> None:
        if self.run_name is None:
            self.run_name = state.run_name

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._start()
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        assert self._writer is not None
        self._writer.add(Metric(name, float(value), now, step) for name, value in metrics.items())

    @override
    def log_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> None:
        client = self._start()
        from mlflow.entities import Param

        params = [Param(name, str(value)) for name, value in _flatten(hyperparameters).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per call
            client.log_batch(self.run_id, params=params[start : start + 100])

    @override
    def log_table(self, columns: Sequence[str], rows: Sequence[Sequence[Any]], name: str, step: int) -> None:
        """The table as the run's artifact ``<name>.json`` (MLflow's table format, shown in its UI)."""
        client = self._start()
        data = {column: [row[index] for row in rows] for index, column in enumerate(columns)}
        client.log_table(self.run_id, data=data, artifact_file=f"{name}.json")

    @override
    def batch_end(self, state: State, logger: Logger) -> None:
        if self._writer is not None and self._writer.pending and int(state.timestamp.batch) % self.flush_interval == 0:
            self.flush()

    def flush(self, wait: bool = False) -> None:
        """Send the buffered metrics, on the writer's thread; with ``wait=True`` return once they were sent or failed.

        A store that fails mid-run (full disk, read-only mount, a server answering 503 or not at all) does not stop
        training: the metrics stay buffered (at most :data:`MAX_BUFFERED` values, the oldest dropped first) and are
        sent again at the next flush; the first failure warns once, and closing warns of anything never written.
        """
        if self._writer is not None:
            self._writer.flush()
            if wait:
                self._writer.wait()

    def _store_failed(self, doing: str, error: Exception) -> None:
        if not self._warned:
            rank_zero_warn(
                f"MLFlowLogger could not {doing} the tracking store {self._client.tracking_uri!r} ({error}). Training "
                "goes on; the metrics stay buffered and are tried again at each flush."
            )
            self._warned = True

    @override
    def log_exception(self, exception: BaseException) -> None:
        """End the run as FAILED (KILLED for ``KeyboardInterrupt``, ``SystemExit`` and preemption)."""
        self._end("KILLED" if isinstance(exception, (KeyboardInterrupt, SystemExit)) else "FAILED")

    @override
    def close(self, state: State | None = None, logger: Logger | None = None) -> None:
        """Write what is buffered and end the run (FINISHED, unless it failed). A later value starts a new run."""
        self._end("FINISHED")

    def _end(self, status: str) -> None:
        if not self._running or self._writer is None:
            return
        self._running, writer, self._writer = False, self._writer, None
        writer.close()  # one more try for what is buffered, waited for
        try:
            self._client.set_terminated(self.run_id, status=status)
        except Exception as error:
            self._store_failed(f"end the run {status} in", error)
        if writer.pending or writer.dropped:
            rank_zero_warn(
                f"MLFlowLogger: {writer.pending + writer.dropped} metric value(s) of run {self.run_id} were never "
                f"written to {self._client.tracking_uri!r} (last error: {writer.error})."
            )

    def _start(self) -> Any:
        """The client, with the experiment and the run made on first use."""
        if self._client is None:
            try:
                from mlflow.tracking import MlflowClient
            except ImportError as error:
                raise ImportError(f"MLFlowLogger needs mlflow: {install_hint('mlflow', 'mlflow-skinny')}") from error
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        if not self._running:
            experiment = self._client.get_experiment_by_name(self.experiment_name)
            if experiment is None:
                experiment_id = self._client.create_experiment(self.experiment_name)
            else:
                experiment_id = experiment.experiment_id
            run = self._client.create_run(experiment_id, run_name=self.run_name, tags=self.tags)
            self.run_id, self._running = run.info.run_id, True
            self._writer = BackgroundWriter(
                functools.partial(self._client.log_batch, self.run_id),
                functools.partial(self._store_failed, "write metrics to"),
                chunk=1000,  # MLflow takes at most 1000 metrics per call
                limit=MAX_BUFFERED,
                name=f"MLFlowLogger {self.run_id}",
            )
        return self._client


def _flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, value in values.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{key}/"))
        else:
            flat[key] = value
    return flat
