"""Old import paths of moved modules: they still import, as the module at its new path, with one ``FutureWarning``
naming the new path (public names are a promise; see docs/layout.md).

``import fabric`` installs the finder (a dictionary look-up per import it is asked about, nothing else). To move a
module, add its old and new path to :data:`MOVED`; remove an entry no sooner than one release later.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any, cast

#: Old dotted path -> new dotted path, for every module moved since the Trainer's ``core/`` regrouping.
MOVED: dict[str, str] = {
    **{
        f"fabric.trainer.{name}": f"fabric.trainer.core.{name}"
        for name in ("algorithm", "callback", "engine", "events", "passes", "state", "time")
    },
    "fabric.trainer.algorithms.surgery": "fabric.trainer.surgery",
    "fabric.trainer.loggers.logger": "fabric.trainer.core.logger",
    "fabric.strategies.deepspeed_config": "fabric.strategies.deepspeed.config",
    "fabric.strategies.deepspeed_precision": "fabric.strategies.deepspeed.precision",
    "fabric.strategies.deepspeed_checkpoint": "fabric.plugins.io.deepspeed_checkpoint",
    "fabric.strategies.deepspeed_safe_load": "fabric.plugins.io.deepspeed_safe_load",
    "fabric.strategies.fsdp_checkpoint": "fabric.strategies.fsdp.checkpoint",
    "fabric.strategies.fsdp_options": "fabric.strategies.fsdp.options",
    "fabric.strategies.launchers.process_exit": "fabric.utilities.processes.exit",
    "fabric.strategies.launchers.processes": "fabric.utilities.processes.supervision",
    "fabric.strategies.launchers.rank_environment": "fabric.utilities.processes.rank_environment",
    "fabric.utilities.worker_processes": "fabric.utilities.processes.workers",
    "fabric_cli.network": "fabric.utilities.network",
}


class MovedModuleFinder:
    """Answers an old path of :data:`MOVED` with the module at its new path, warning once per process: a meta path
    finder and its own loader by protocol (importlib's ABCs and ``@override`` would double the cost of ``import
    fabric``)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, cast(Any, self))  # a loader by protocol

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        # stacklevel 2 is the importing line: warnings skips the import system's own frames
        warnings.warn(
            f"{spec.name} moved to {new}: import it from there (the old path goes in a later release).",
            FutureWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at the new path is already imported."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
