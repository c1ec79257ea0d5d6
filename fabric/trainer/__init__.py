"""A Composer-style Trainer built on Fabric: events, algorithms, callbacks, time units and schedules.

Names load on first use, so ``import fabric.trainer`` stays cheap. Composer's model names are here too:
``ComposerModel``, ``ComposerClassifier`` and ``ComposerResNet`` (``from composer.models import ...`` becomes
``from fabric.trainer import ...``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric.utilities.lazy import lazy_exports

if TYPE_CHECKING:
    from fabric.trainer.algorithm import Algorithm
    from fabric.trainer.callback import Callback
    from fabric.trainer.classifier import ComposerClassifier, ComposerResNet, TrainerClassifier
    from fabric.trainer.data_spec import DataSpec
    from fabric.trainer.engine import Engine
    from fabric.trainer.evaluation import Evaluator
    from fabric.trainer.events import Event
    from fabric.trainer.model import ComposerModel, TrainerModel
    from fabric.trainer.state import State
    from fabric.trainer.time import Time, Timestamp, TimeUnit
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
        "Algorithm": "fabric.trainer.algorithm",
        "Callback": "fabric.trainer.callback",
        "ComposerClassifier": "fabric.trainer.classifier",
        "ComposerModel": "fabric.trainer.model",
        "ComposerResNet": "fabric.trainer.classifier",
        "DataSpec": "fabric.trainer.data_spec",
        "Engine": "fabric.trainer.engine",
        "Evaluator": "fabric.trainer.evaluation",
        "Event": "fabric.trainer.events",
        "State": "fabric.trainer.state",
        "Time": "fabric.trainer.time",
        "TimeUnit": "fabric.trainer.time",
        "Timestamp": "fabric.trainer.time",
        "Trainer": "fabric.trainer.trainer",
        "TrainerClassifier": "fabric.trainer.classifier",
        "TrainerModel": "fabric.trainer.model",
    },
)
