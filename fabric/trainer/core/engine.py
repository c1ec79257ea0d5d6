"""``Engine``: runs the algorithms and callbacks registered for an event, in the right order.

Everything per event is precomputed once: the algorithm order after the passes, and the callback
methods that are actually overridden. Running an event then costs a ``match`` call per algorithm and
one call per interested callback, with no string handling in the hot path. Callbacks run after
algorithms (they observe what algorithms did), and loggers run after callbacks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.callback import Callback, Handler, warn_unknown_hooks
from fabric.trainer.core.events import Event
from fabric.trainer.core.passes import DEFAULT_PASSES, AlgorithmPass, check_compatibility
from fabric.trainer.core.state import State
from fabric.trainer.loggers.logger import Logger

#: What an event nobody listens to runs: a builtin that returns ``()`` and runs no Python frame.
_IDLE: Callable[[], object] = tuple


class Engine:
    def __init__(
        self,
        state: State,
        logger: Logger,
        algorithms: Sequence[Algorithm] = (),
        callbacks: Sequence[Callback] = (),
        loggers: Sequence[Callback] = (),
        passes: Sequence[AlgorithmPass] = DEFAULT_PASSES,
    ) -> None:
        check_compatibility(algorithms)
        self.state = state
        self.logger = logger
        ordered: dict[Event, tuple[Algorithm, ...]] = {}
        for event in Event:
            in_order = list(algorithms)
            for algorithm_pass in passes:
                in_order = algorithm_pass(in_order, event)
            ordered[event] = tuple(in_order)
        self._observers = (*callbacks, *loggers)
        for observer in self._observers:
            warn_unknown_hooks(observer)  # a misspelt hook would otherwise never run, silently
        per_observer = [observer.handlers() for observer in self._observers]
        # Only events something listens to get an entry: most events of a plain run cost one dict lookup.
        self._work: dict[Event, tuple[tuple[Algorithm, ...], tuple[Handler, ...]]] = {}
        for event in Event:
            handlers = tuple(observer[event] for observer in per_observer if event in observer)
            if ordered[event] or handlers:
                self._work[event] = (ordered[event], handlers)
        #: ``fire[event]()`` is ``run_event(event)`` for the per-batch path: for an event nothing listens to it is a
        #: C-level no-op, which costs no Python call (a plain run fires 13 such events per batch).
        self.fire: dict[Event, Callable[[], object]] = {
            event: functools.partial(self.run_event, event) if event in self._work else _IDLE for event in Event
        }

    def run_event(self, event: Event) -> None:
        work = self._work.get(event)
        if work is None:
            return
        algorithms, handlers = work
        state, logger = self.state, self.logger
        for algorithm in algorithms:
            if algorithm.match(event, state):
                algorithm.apply(event, state, logger)
        for handler in handlers:
            handler(state, logger)

    def close(self) -> None:
        """Every callback's, then every logger's ``close(state, logger)``, then their ``post_close()``.

        As in Composer, a callback whose ``close`` raised gets no ``post_close``, and one failure does not stop
        the others from closing. Unlike Composer, failures are not only logged: one is raised as it is at the
        end, several as one ``RuntimeError`` naming each.
        """
        errors: list[Exception] = []
        closed: list[Callback] = []
        for observer in self._observers:
            try:
                observer.close(self.state, self.logger)
            except Exception as error:
                errors.append(error)
            else:
                closed.append(observer)
        for observer in closed:
            try:
                observer.post_close()
            except Exception as error:
                errors.append(error)
        if len(errors) == 1:
            raise errors[0]
        if errors:
            failures = "; ".join(f"{type(error).__name__}: {error}" for error in errors)
            raise RuntimeError(f"Closing the callbacks failed {len(errors)} times: {failures}") from errors[0]
