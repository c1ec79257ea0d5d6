"""A dependency-free logger that writes metrics to a CSV file and hyperparameters to a JSON file."""

from __future__ import annotations

import argparse
import csv
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from typing_extensions import override

from fabric.loggers.logger import VersionedLogger, params_to_dict, prepare_metrics
from fabric.utilities.rank_zero import rank_zero_only


class CSVLogger(VersionedLogger):
    """Logs metrics to ``<root_dir>/<name>/<version>/metrics.csv`` and hyperparameters to ``hparams.json``.

    The CSV file has a ``step`` column plus one column per metric key ever logged. A key that shows up
    later widens the header by rewriting the file, so earlier rows keep their values and get empty cells
    for the new column. Rows are buffered and written every ``flush_logs_every_n_steps`` calls to
    :meth:`log_metrics` and on :meth:`save` / :meth:`finalize`, so logging stays cheap on slow filesystems.

    Args:
        root_dir: Local directory or fsspec URL (e.g. ``memory://runs``) that holds all experiments.
        name: Experiment name, the sub-directory of ``root_dir``.
        version: Run number (directory ``version_<N>``) or directory name. ``None`` picks the next free number.
        prefix: Prepended to every metric key as ``<prefix>/<key>``.
        flush_logs_every_n_steps: How many :meth:`log_metrics` calls to buffer before writing.
    """

    METRICS_FILE_NAME = "metrics.csv"
    HPARAMS_FILE_NAME = "hparams.json"
    STEP_COLUMN = "step"

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        name: str = "fabric_logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
    ) -> None:
        if flush_logs_every_n_steps < 1:
            raise ValueError(f"`flush_logs_every_n_steps` must be at least 1, got {flush_logs_every_n_steps}.")
        super().__init__(root_dir, name, version, prefix)
        self._flush_every = flush_logs_every_n_steps
        self._hparams: dict[str, Any] = {}
        self._rows: list[dict[str, float]] = []  # logged but not yet written
        self._columns = [self.STEP_COLUMN]  # every column seen so far, in order of appearance
        self._file_columns: list[str] | None = None  # header of the file on disk; None until first read
        self._rows_logged = 0
        self._warned_step_conflict = False
        self._storage: tuple[AbstractFileSystem, str] | None = None  # filesystem and path of the log dir

    @rank_zero_only
    @override
    def log_metrics(self, metrics: Mapping[str, float | torch.Tensor], step: int | None = None) -> None:
        """Buffer one row; ``step`` defaults to a metric named ``step``, else the number of rows logged before.

        A metric named ``step`` goes to the step column, as in Lightning's CSV logger (litgpt logs one);
        when ``step=`` is given too and differs, the column holds ``step=`` and a warning says so, once.
        """
        row = prepare_metrics(metrics, self._prefix)
        logged_step = row.pop(self.STEP_COLUMN, None)
        row_step: float = step if step is not None else self._rows_logged if logged_step is None else logged_step
        if step is not None and logged_step is not None and logged_step != step and not self._warned_step_conflict:
            self._warned_step_conflict = True
            warnings.warn(
                f"CSVLogger: the metric {self.STEP_COLUMN!r} ({logged_step}) differs from step={step}; the "
                f"{self.STEP_COLUMN!r} column of {self.METRICS_FILE_NAME} holds step=, not that metric.",
                stacklevel=2,
            )
        self._make_log_dir()  # claims the version directory on first use, so another logger picks the next number
        self._columns.extend(key for key in row if key not in self._columns)
        self._rows.append({self.STEP_COLUMN: row_step, **row})
        self._rows_logged += 1
        if len(self._rows) >= self._flush_every:
            self.save()

    @rank_zero_only
    @override
    def log_hyperparams(self, params: Mapping[str, Any] | argparse.Namespace) -> None:
        """Merge ``params`` into earlier ones and write them all to ``hparams.json`` right away.

        Values JSON cannot represent (paths, devices, ...) are written as their ``str()``.
        """
        self._hparams.update(params_to_dict(params))
        fs, log_dir = self._make_log_dir()
        with fs.open(f"{log_dir}/{self.HPARAMS_FILE_NAME}", "w") as file:
            json.dump(self._hparams, file, indent=2, default=str)

    @rank_zero_only
    @override
    def save(self) -> None:
        """Write the buffered rows to ``metrics.csv``."""
        if not self._rows:
            return
        fs, log_dir = self._make_log_dir()
        path = f"{log_dir}/{self.METRICS_FILE_NAME}"
        if self._file_columns is None:
            # A file may already exist when a named version is resumed: keep its rows and its columns.
            self._file_columns = _read_header(fs, path)
            self._columns = self._file_columns + [key for key in self._columns if key not in self._file_columns]
        if self._file_columns == self._columns:
            with fs.open(path, "a", newline="") as file:
                csv.DictWriter(file, fieldnames=self._columns).writerows(self._rows)
        else:
            self._rewrite(fs, path)
            self._file_columns = list(self._columns)
        self._rows.clear()

    def _rewrite(self, fs: AbstractFileSystem, path: str) -> None:
        """Write the whole file with the current header: rows already on disk, then the buffered ones."""
        old_rows: list[dict[str, str]] = []
        if fs.exists(path):
            with fs.open(path, "r", newline="") as file:
                old_rows = list(csv.DictReader(file))
        # Write a new file and move it over the old one, so a crash mid-write cannot lose earlier rows.
        temporary = f"{path}.tmp"
        with fs.open(temporary, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=self._columns, restval="")
            writer.writeheader()
            writer.writerows(old_rows)
            writer.writerows(self._rows)
        fs.mv(temporary, path)

    def _make_log_dir(self) -> tuple[AbstractFileSystem, str]:
        """Create the log directory once; return its filesystem and its path on that filesystem."""
        if self._storage is None:
            fs, log_dir = url_to_fs(self.log_dir)
            fs.makedirs(log_dir, exist_ok=True)
            self._storage = fs, log_dir
        return self._storage


def _read_header(fs: AbstractFileSystem, path: str) -> list[str]:
    """Column names of an existing CSV file, or an empty list when there is no file."""
    if not fs.exists(path):
        return []
    with fs.open(path, "r", newline="") as file:
        return next(csv.reader(file), [])
