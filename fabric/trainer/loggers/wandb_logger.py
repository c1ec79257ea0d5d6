"""``WandBLogger``: the Trainer's metrics, configuration and (when asked) checkpoints in a Weights & Biases run.

Needs the ``wandb`` extra (``pip install -e ".[wandb]"`` from the checkout); ``wandb`` is imported when the run
starts (the first value logged), not before. Only global rank 0 logs::

    logger = WandBLogger(project="mnist", log_artifacts=True, init_kwargs={"mode": "offline"})
    trainer = Trainer(..., loggers=logger, save_folder="checkpoints/{run_name}")
    trainer.logger.log_hyperparameters({"lr": 0.1})
    trainer.fit()
    trainer.close()   # finishes the run (offline runs: ``wandb sync wandb/offline-run-*`` uploads them)

The run is named after the Trainer's ``run_name`` unless ``name`` is given. Metrics keep the Trainer's
names and the global batch count as W&B's ``step`` (values logged at one step form one history row).
Hyperparameters go to the run's config. With ``log_artifacts=True`` every checkpoint the Trainer saves
to a local folder is logged as a ``model`` artifact named ``<run name>-checkpoint`` whose alias is
the file name (sharded checkpoint folders as a whole); checkpoints in remote folders are not.
``init_kwargs`` go to ``wandb.init`` (``mode``, ``dir``, ``config``, ``notes``, ...).
W&B writes the run's files from a service process, after ``finish()`` returns: to read an offline
run's files in the same process, call ``wandb.teardown()`` first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from fabric.trainer.core.callback import SavesCheckpoints
from fabric.trainer.loggers.destination import LoggerDestination
from fabric.utilities.lazy import install_hint
from fabric.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State

_OWN_OPTIONS = ("project", "group", "name", "entity", "tags")


class WandBLogger(LoggerDestination):
    """Logs to a W&B run: ``project``, ``group``, ``name``, ``entity`` and ``tags`` as in ``wandb.init``."""

    def __init__(
        self,
        project: str | None = None,
        group: str | None = None,
        name: str | None = None,
        entity: str | None = None,
        tags: Sequence[str] | None = None,
        log_artifacts: bool = False,
        init_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        init_kwargs = dict(init_kwargs or {})
        doubled = sorted(set(init_kwargs) & set(_OWN_OPTIONS))
        if doubled:
            raise ValueError(f"Pass {doubled} as WandBLogger arguments, not in init_kwargs.")
        if isinstance(tags, str):
            raise TypeError(f"tags must be a list of strings, got the string {tags!r}.")
        self.init_kwargs = {
            **init_kwargs,
            "project": project,
            "group": group,
            "name": name,
            "entity": entity,
            "tags": list(tags) if tags is not None else None,
        }
        self.log_artifacts = log_artifacts
        #: The ``wandb`` run, once started.
        self.run: Any = None
        self._logged_checkpoints: set[str] = set()
        self._warned_remote = False

    @override
    def init(self, state: State, logger: Logger) -> None:
        if self.init_kwargs["name"] is None:
            self.init_kwargs["name"] = state.run_name

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._start().log(dict(metrics), step=step)

    @override
    def log_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> None:
        self._start().config.update(dict(hyperparameters), allow_val_change=True)

    @override
    def log_table(self, columns: Sequence[str], rows: Sequence[Sequence[Any]], name: str, step: int) -> None:
        import wandb

        self._start().log({name: wandb.Table(columns=list(columns), rows=[list(row) for row in rows])}, step=step)

    @override
    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        self._log_new_checkpoints(state)

    @override
    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        self._log_new_checkpoints(state)

    @override
    def fit_end(self, state: State, logger: Logger) -> None:
        self._log_new_checkpoints(state)

    @override
    def log_exception(self, exception: BaseException) -> None:
        """Finish the run with a non-zero exit code, so W&B shows it failed: a ``SystemExit``'s own code (the
        Trainer's preemption exits 75), else 1."""
        code = exception.code if isinstance(exception, SystemExit) and isinstance(exception.code, int) else 1
        self._finish(code or 1)

    @override
    def close(self, state: State | None = None, logger: Logger | None = None) -> None:
        """Finish the run (exit code 0, unless it failed). A later value starts a new run."""
        self._finish(0)

    def _finish(self, exit_code: int) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish(exit_code=exit_code)

    def _start(self) -> Any:
        if self.run is None:
            try:
                import wandb
            except ImportError as error:
                raise ImportError(f"WandBLogger needs wandb: {install_hint('wandb', 'wandb')}") from error
            self.run = wandb.init(**{key: value for key, value in self.init_kwargs.items() if value is not None})
        return self.run

    def _log_new_checkpoints(self, state: State) -> None:
        """Log the checkpoints the Trainer's savers wrote since the last call (they ran before the loggers)."""
        if not self.log_artifacts:
            return
        for saver in (callback for callback in state.callbacks if isinstance(callback, SavesCheckpoints)):
            for path in saver.saved:
                if path not in self._logged_checkpoints:
                    self._logged_checkpoints.add(path)
                    self._log_checkpoint(path)

    def _log_checkpoint(self, path: str) -> None:
        if not os.path.exists(path):  # a remote URL (or a checkpoint pruned already)
            if not self._warned_remote:
                self._warned_remote = True
                rank_zero_warn(f"WandBLogger(log_artifacts=True) logs local checkpoints only; {path} is not one.")
            return
        import wandb

        run = self._start()
        artifact = wandb.Artifact(f"{run.name}-checkpoint", type="model")
        if os.path.isdir(path):
            artifact.add_dir(path)
        else:
            artifact.add_file(path)
        run.log_artifact(artifact, aliases=[os.path.basename(os.path.normpath(path))])
