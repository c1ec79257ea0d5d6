"""A logger that writes TensorBoard event files through ``torch.utils.tensorboard.SummaryWriter``.

``tensorboard`` is an optional extra, so it is imported only when the first event is written: importing
this module, or constructing the logger, works without it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.imports import RequirementCache
from typing_extensions import override

from fabric.loggers.logger import VersionedLogger, params_to_dict, prepare_metrics
from fabric.utilities.lazy import install_hint
from fabric.utilities.rank_zero import rank_zero_only

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

_TENSORBOARD_AVAILABLE = RequirementCache("tensorboard")


class TensorBoardLogger(VersionedLogger):
    """Logs metrics as TensorBoard scalars and hyperparameters to TensorBoard's HPARAMS tab.

    Event files go to ``<root_dir>/<name>/<version>``; view them with ``tensorboard --logdir <root_dir>``.
    The ``SummaryWriter`` is created on first use, on global rank 0 only.

    Args:
        root_dir: Directory that holds all experiments.
        name: Experiment name, the sub-directory of ``root_dir``.
        version: Run number (directory ``version_<N>``) or directory name. ``None`` picks the next free number.
        default_hp_metric: When logging hyperparameters, also log a placeholder metric ``hp_metric = -1``
            so the HPARAMS tab lists the run; log ``hp_metric`` yourself later to give it a real value.
        prefix: Prepended to every metric key as ``<prefix>/<key>``, which groups the charts in TensorBoard.
        **summary_writer_kwargs: Passed on to ``SummaryWriter``, e.g. ``flush_secs``.
    """

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        name: str = "fabric_logs",
        version: int | str | None = None,
        default_hp_metric: bool = False,
        prefix: str = "",
        **summary_writer_kwargs: Any,
    ) -> None:
        super().__init__(root_dir, name, version, prefix)
        self._default_hp_metric = default_hp_metric
        self._summary_writer_kwargs = summary_writer_kwargs
        self._summary_writer: SummaryWriter | None = None
        self._calls = 0  # log_metrics calls so far, the step used when none is given

    @property
    @rank_zero_only
    def experiment(self) -> SummaryWriter:
        """The underlying ``SummaryWriter``, for anything beyond scalars (images, histograms, ...).

        It is ``None`` on ranks other than 0, where nothing is written.
        """
        return self._writer()

    @rank_zero_only
    @override
    def log_metrics(self, metrics: Mapping[str, float | torch.Tensor], step: int | None = None) -> None:
        """Add one scalar per key; ``step`` defaults to the number of earlier calls."""
        writer = self._writer()
        for key, value in prepare_metrics(metrics, self._prefix).items():
            writer.add_scalar(key, value, global_step=self._calls if step is None else step)
        self._calls += 1

    @rank_zero_only
    @override
    def log_hyperparams(self, params: Mapping[str, Any] | argparse.Namespace) -> None:
        """Write the hyperparameters for TensorBoard's HPARAMS tab.

        Nested mappings are flattened to ``outer/inner`` keys. TensorBoard only stores numbers, strings
        and booleans, so any other value is written as its ``str()``.
        """
        metrics = {"hp_metric": -1.0} if self._default_hp_metric else {}
        # run_name="." keeps the hyperparameters in this run's directory instead of a new sub-directory.
        self._writer().add_hparams(_flatten(params_to_dict(params)), metrics, run_name=".")

    @rank_zero_only
    @override
    def save(self) -> None:
        """Flush pending events to disk."""
        if self._summary_writer is not None:
            self._summary_writer.flush()

    @rank_zero_only
    @override
    def finalize(self, status: str) -> None:
        """Flush and close the event file; logging again afterwards starts a new event file."""
        if self._summary_writer is not None:
            self._summary_writer.close()
            self._summary_writer = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the ``SummaryWriter`` (it holds threads and open files); it is recreated on use."""
        state = self.__dict__.copy()
        state["_summary_writer"] = None
        return state

    def _writer(self) -> SummaryWriter:
        """Return the ``SummaryWriter``, creating it on first use. Only call this from rank-zero methods."""
        if self._summary_writer is None:
            if not _TENSORBOARD_AVAILABLE:
                raise ModuleNotFoundError(
                    f"TensorBoardLogger needs the `tensorboard` package: {install_hint('tensorboard', 'tensorboard')}"
                )
            from torch.utils.tensorboard import SummaryWriter

            self._summary_writer = SummaryWriter(log_dir=self.log_dir, **self._summary_writer_kwargs)
        return self._summary_writer


def _flatten(params: Mapping[str, Any], parent_key: str = "") -> dict[str, bool | int | float | str]:
    """Flatten nested mappings into ``outer/inner`` keys and turn unsupported values into strings."""
    flat: dict[str, bool | int | float | str] = {}
    for key, value in params.items():
        full_key = f"{parent_key}/{key}" if parent_key else str(key)
        if isinstance(value, Mapping):
            flat.update(_flatten(value, full_key))
        else:
            flat[full_key] = value if isinstance(value, bool | int | float | str) else str(value)
    return flat
