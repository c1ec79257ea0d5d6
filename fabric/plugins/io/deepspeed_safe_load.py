"""Loading DeepSpeed checkpoint files without running code from them (``weights_only=True``).

DeepSpeed reads its files with ``torch.load(weights_only=False)``, so a crafted checkpoint directory
would run arbitrary code on load. Under ``weights_only=True`` Fabric does two things:

- before anything is loaded, it lists the classes and functions each file of the checkpoint names
  (without unpickling it) and refuses any file naming one beyond torch's safe set and DeepSpeed's own
  plain records, with a :class:`CheckpointError` naming the file: nothing has been changed yet;
- while DeepSpeed loads, every ``torch.load`` is forced to ``weights_only=True`` (torch's
  ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``), so no file can run code even if the first check missed it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fabric.utilities.exceptions import CheckpointError

_FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
_FORCE_NO = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"

#: DeepSpeed's records in its optimizer files: dataclasses, enums and plain objects without custom unpickling.
_DEEPSPEED_RECORDS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.fp16.loss_scaler.LossScaleConfig",
    "deepspeed.runtime.fp16.loss_scaler.LossScaleProfile",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def _deepspeed_records() -> list[Any]:
    """The classes of :data:`_DEEPSPEED_RECORDS` this DeepSpeed release has."""
    found = []
    for qualified in _DEEPSPEED_RECORDS:
        module, _, name = qualified.rpartition(".")
        with contextlib.suppress(ImportError):
            record = getattr(importlib.import_module(module), name, None)
            if record is not None:
                found.append(record)
    return found


def check_files(directory: Path) -> None:
    """Refuse the first file in ``directory`` that names a class or function safe loading would not build.

    Reads only each file's pickle opcodes; nothing is unpickled.
    """
    allowed = set(_DEEPSPEED_RECORDS)
    for file in sorted(directory.glob("*.pt")):
        if not zipfile.is_zipfile(file):
            continue  # the legacy format cannot be listed; forced safe loading still covers it
        refused = sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(file)) - allowed)
        if refused:
            raise CheckpointError(
                f"{os.fspath(file)!r} holds objects that safe loading (weights_only=True) refuses: "
                f"{', '.join(refused)}. Only if you trust where this checkpoint came from, load it with "
                "weights_only=False."
            )


@contextlib.contextmanager
def safe_loading(directory: Path, weights_only: bool) -> Iterator[None]:
    """Check the files of ``directory`` (a checkpoint's tag directory), then load in the block with
    :func:`forced_safe_loading`; with ``weights_only=False`` (a trusted checkpoint), just load."""
    if not weights_only:
        yield
        return
    check_files(directory)
    with forced_safe_loading():
        yield


@contextlib.contextmanager
def forced_safe_loading() -> Iterator[None]:
    """Every ``torch.load`` in the block, DeepSpeed's included, runs with ``weights_only=True``.

    DeepSpeed's own records are allowed. A refused object raises :class:`CheckpointError`.
    """
    saved = {name: os.environ.pop(name, None) for name in (_FORCE, _FORCE_NO)}
    os.environ[_FORCE] = "1"
    try:
        with torch.serialization.safe_globals(_deepspeed_records()):
            yield
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"The DeepSpeed checkpoint holds objects that safe loading (weights_only=True) refuses: {error}"
        ) from error
    finally:
        del os.environ[_FORCE]
        os.environ.update({name: value for name, value in saved.items() if value is not None})
