"""``Engine``: runs the algorithms and callbacks registered for an event, in the right order.

Everything per event is precomputed once: the algorithm order after the passes, and the callback
methods that are actually overridden. Running an event then costs a ``match`` call per algorithm and
one call per interested callback, with no string handling in the hot path. Callbacks run after
algorithms (they observe what algorithms did), and loggers run after callbacks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fabric.trainer.algorithm import Algorithm
from fabric.trainer.callback import Callback
from fabric.trainer.events import Event
from fabric.trainer.passes import DEFAULT_PASSES, AlgorithmPass, check_compatibility
from fabric.trainer.state import State

Handler = Callable[[State, Any], None]


class Engine:
    def __init__(
        self,
        state: State,
        logger: Any,
        algorithms: Sequence[Algorithm] = (),
        callbacks: Sequence[Callback] = (),
        loggers: Sequence[Callback] = (),
        passes: Sequence[AlgorithmPass] = DEFAULT_PASSES,
    ) -> None:
        check_compatibility(algorithms)
        self.state = state
        self.logger = logger
        self._algorithms: dict[Event, tuple[Algorithm, ...]] = {}
        for event in Event:
            ordered = list(algorithms)
            for algorithm_pass in passes:
                ordered = algorithm_pass(ordered, event)
            self._algorithms[event] = tuple(ordered)
        per_observer = [observer.handlers() for observer in [*callbacks, *loggers]]
        self._handlers: dict[Event, tuple[Handler, ...]] = {
            event: tuple(handlers[event] for handlers in per_observer if event in handlers) for event in Event
        }

    def run_event(self, event: Event) -> None:
        state, logger = self.state, self.logger
        for algorithm in self._algorithms[event]:
            if algorithm.match(event, state):
                algorithm.apply(event, state, logger)
        for handler in self._handlers[event]:
            handler(state, logger)
