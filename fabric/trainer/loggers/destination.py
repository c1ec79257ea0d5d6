"""``LoggerDestination``: where the values that algorithms, callbacks and the loop log end up.

A destination is also a :class:`~fabric.trainer.Callback`, so it sees every event it
overrides (a progress bar redraws at ``batch_end``). Values reach it through the trainer's
:class:`~fabric.trainer.core.logger.Logger`, already converted to Python numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from typing_extensions import override

from fabric.trainer.core.callback import Callback
from fabric.trainer.core.logger import Logger, LogSink

if TYPE_CHECKING:
    from fabric.trainer.core.state import State


class LoggerDestination(Callback, LogSink):
    """Base class of the trainer's loggers; every method is a no-op until overridden."""

    #: Whether ranks other than global rank 0 keep this destination. Files and bars are written once,
    #: by rank 0; an in-memory record for tests may want every rank's values.
    all_ranks: ClassVar[bool] = False

    @override
    def close(self, state: State | None = None, logger: Logger | None = None) -> None:
        """Flush and release files or bars; ``Trainer.close()`` calls it with its state and logger, as Composer's."""
