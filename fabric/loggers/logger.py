"""The interface every experiment logger implements, plus the helpers the built-in loggers share.

Loggers receive metrics and hyperparameters from the training loop and persist them somewhere (a CSV
file, TensorBoard event files, ...). Only global rank 0 writes, so subclasses decorate every method
that writes with :func:`~fabric.utilities.rank_zero.rank_zero_only`.
"""

from __future__ import annotations

import argparse
import os
import posixpath
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch
from fsspec.core import url_to_fs
from typing_extensions import override

from fabric.utilities.rank_zero import rank_zero_only


class Logger(ABC):
    """Base class for experiment loggers.

    A run is identified by ``name`` and ``version``; loggers that write files put them under
    ``log_dir``, usually ``<root_dir>/<name>/<version>``. Loggers may buffer writes, so call
    :meth:`save` to flush and :meth:`finalize` once the run is over.
    """

    @property
    @abstractmethod
    def name(self) -> str | None:
        """Name of the experiment, shared by all its versions (runs)."""

    @property
    @abstractmethod
    def version(self) -> str | int | None:
        """Version (run) of the experiment."""

    @property
    def root_dir(self) -> str | None:
        """Directory that holds all experiments, or None for loggers that do not write files."""
        return None

    @property
    def log_dir(self) -> str | None:
        """Directory this run writes to, or None for loggers that do not write files."""
        return None

    @abstractmethod
    def log_metrics(self, metrics: Mapping[str, float | torch.Tensor], step: int | None = None) -> None:
        """Record scalar metrics, e.g. ``{"loss": 0.25}``, at the given step."""

    @abstractmethod
    def log_hyperparams(self, params: Mapping[str, Any] | argparse.Namespace) -> None:
        """Record the hyperparameters of the run, so runs can be compared later."""

    def save(self) -> None:  # noqa: B027 - an optional hook whose default is to do nothing
        """Flush buffered data to storage. Loggers that never buffer leave this as a no-op."""

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Flush and release resources at the end of the run; ``status`` is e.g. ``"success"`` or ``"failed"``."""
        self.save()


class VersionedLogger(Logger):
    """A logger that writes into ``<root_dir>/<name>/<version>`` (the CSV and TensorBoard loggers): that directory's
    parts, the version chosen on first access when none was given, and the prefix of every metric key."""

    def __init__(self, root_dir: str | os.PathLike[str], name: str, version: int | str | None, prefix: str) -> None:
        self._root_dir = os.fspath(root_dir)
        self._name = name
        self._version = version
        self._prefix = prefix

    @property
    @override
    def name(self) -> str:
        return self._name

    @property
    @override
    def version(self) -> int | str:
        """The run's version; when none was given, the next free number, chosen on first access."""
        if self._version is None:
            self._version = next_version(self._root_dir, self._name)
        return self._version

    @property
    @override
    def root_dir(self) -> str:
        return self._root_dir

    @property
    @override
    def log_dir(self) -> str:
        return os.path.join(self._root_dir, self._name, version_dir_name(self.version))


def next_version(root_dir: str, name: str) -> int:
    """Return the first unused ``version_<N>`` number under ``<root_dir>/<name>`` (0 if there is none yet).

    Numbers are found by listing the existing directories, so a new run never overwrites an old one.
    ``root_dir`` may be a local path or any fsspec URL such as ``memory://runs``.
    """
    fs, experiment_dir = url_to_fs(os.path.join(root_dir, name))
    if not fs.isdir(experiment_dir):
        return 0
    versions = []
    for entry in fs.ls(experiment_dir, detail=True):
        directory = posixpath.basename(entry["name"].rstrip("/"))
        number = directory.removeprefix("version_")
        if entry["type"] == "directory" and directory.startswith("version_") and number.isdigit():
            versions.append(int(number))
    return max(versions, default=-1) + 1


def version_dir_name(version: int | str) -> str:
    """Directory name of a version: ``version_<N>`` for a number, a string is used as is."""
    return version if isinstance(version, str) else f"version_{version}"


def prepare_metrics(metrics: Mapping[str, float | torch.Tensor], prefix: str = "") -> dict[str, float]:
    """Turn tensors into Python numbers and prepend ``<prefix>/`` to every key when a prefix is given.

    Converting right away means a bad value fails at the ``log_metrics`` call that passed it, and no
    device tensors are kept alive in a logger's buffer.
    """
    return {f"{prefix}/{key}" if prefix else key: scalar(key, value) for key, value in metrics.items()}


def scalar(key: str, value: float | torch.Tensor) -> float:
    """``value`` as a Python number: a one-element tensor's item; any other tensor is an error naming ``key``."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Metric {key!r} must be a single number, but got a tensor of shape {tuple(value.shape)}.")
        return value.item()
    return value


def params_to_dict(params: Mapping[str, Any] | argparse.Namespace) -> dict[str, Any]:
    """Return hyperparameters as a plain dict, accepting an ``argparse.Namespace`` as well as a mapping."""
    return dict(vars(params)) if isinstance(params, argparse.Namespace) else dict(params)
