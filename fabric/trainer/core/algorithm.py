"""``Algorithm``: a training method that changes the State at the events it matches.

An algorithm says *when* it acts (``match``) and *what* it does (``apply``). The engine runs every
algorithm whose ``match`` is true, in an order decided by passes (:mod:`fabric.trainer.core.passes`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from fabric.trainer.core.events import Event
    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State


class Algorithm(ABC):
    """Base class of training methods (MixUp, LabelSmoothing, EMA, ...)."""

    #: Whether two instances may run in one Trainer: yes, as in Composer (each is checkpointed under its own
    #: name), unless two copies would fight over one thing (two EMAs over the model's weights).
    allow_multiple_instances: ClassVar[bool] = True
    #: Algorithm classes this one cannot run together with (the class docstring says why).
    incompatible_with: ClassVar[tuple[type[Algorithm], ...]] = ()
    #: Why those cannot run together; part of the error a user sees.
    incompatibility_reason: ClassVar[str] = ""

    @abstractmethod
    def match(self, event: Event, state: State) -> bool:
        """Whether to act at this event."""

    @abstractmethod
    def apply(self, event: Event, state: State, logger: Logger) -> None:
        """Act: read and change ``state``; ``logger`` records what it did."""

    def state_dict(self) -> dict[str, Any]:
        """What to checkpoint so a resumed run continues exactly (default: nothing)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Restore :meth:`state_dict`."""

    def exported_weights(self, state: State) -> AbstractContextManager[None]:
        """While a weights-only checkpoint (the deployable model) is written, the model holds these weights.

        Default: the training weights, unchanged. An algorithm that keeps better weights to deploy (EMA's
        average) swaps them in here and the training weights back on exit, so full checkpoints and training
        never see them.
        """
        return nullcontext()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
