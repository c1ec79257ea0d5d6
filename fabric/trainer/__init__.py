"""A Composer-style Trainer built on Fabric: events, algorithms, callbacks, time units and schedules.

Names load on first use, so ``import fabric.trainer`` stays cheap. Composer's model names are here too:
``ComposerModel``, ``ComposerClassifier`` and ``ComposerResNet`` (``from composer.models import ...`` becomes
``from fabric.trainer import ...``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric.utilities.lazy import lazy_exports

if TYPE_CHECKING:
    from fabric.trainer.classifier import ComposerClassifier, ComposerResNet, TrainerClassifier
    from fabric.trainer.core.algorithm import Algorithm
    from fabric.trainer.core.callback import Callback
    from fabric.trainer.core.engine import Engine
    from fabric.trainer.core.events import Event
    from fabric.trainer.core.state import State
    from fabric.trainer.core.time import Time, Timestamp, TimeUnit
    from fabric.trainer.data_spec import DataSpec
    from fabric.trainer.evaluation import Evaluator
    from fabric.trainer.model import ComposerModel, TrainerModel
    from fabric.trainer.trainer import Trainer

__all__ = [
    "Algorithm",
    "Callback",
    "ComposerClassifier",
    "ComposerModel",
    "ComposerResNet",
    "DataSpec",
    "Engine",
    "Evaluator",
    "Event",
    "State",
    "Time",
    "TimeUnit",
    "Timestamp",
    "Trainer",
    "TrainerClassifier",
    "TrainerModel",
]
__getattr__ = lazy_exports(
    __name__,
    {
        "Algorithm": "fabric.trainer.core.algorithm",
        "Callback": "fabric.trainer.core.callback",
        "ComposerClassifier": "fabric.trainer.classifier",
        "ComposerModel": "fabric.trainer.model",
        "ComposerResNet": "fabric.trainer.classifier",
        "DataSpec": "fabric.trainer.data_spec",
        "Engine": "fabric.trainer.core.engine",
        "Evaluator": "fabric.trainer.evaluation",
        "Event": "fabric.trainer.core.events",
        "State": "fabric.trainer.core.state",
        "Time": "fabric.trainer.core.time",
        "TimeUnit": "fabric.trainer.core.time",
        "Timestamp": "fabric.trainer.core.time",
        "Trainer": "fabric.trainer.trainer",
        "TrainerClassifier": "fabric.trainer.classifier",
        "TrainerModel": "fabric.trainer.model",
    },
)
