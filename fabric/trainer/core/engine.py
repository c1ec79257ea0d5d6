"""``Engine``: runs the algorithms and callbacks registered for an event, in the right order.

Everything per event is precomputed once: the algorithm order after the passes, and the callback
methods that are actually overridden. Running an event then costs a ``match`` call per algorithm and
one call per interested callback, with no string handling in the hot path. Callbacks run after
algorithms (they observe what algorithms did), and loggers run after callbacks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.callback import Callback, Handler, warn_unknown_hooks
from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.passes import DEFAULT_PASSES, AlgorithmPass, check_compatibility
from fabric.trainer.core.state import State

#: What an event nobody listens to runs: a builtin that returns ``()`` and runs no Python frame.
_IDLE: Callable[[], object] = tuple

Firing = Callable[[], object]


@dataclasses.dataclass(frozen=True, slots=True)
class BatchEvents:
    """``run_event`` bound to each per-batch event (field ``before_forward`` fires ``Event.BEFORE_FORWARD``), or a
    C-level no-op for an event nothing listens to: the per-batch path calls ``engine.fire.before_forward()``.

    Attributes rather than a dict keyed by ``Event``: on Python 3.11 reading ``Event.BEFORE_FORWARD`` runs the Enum
    metaclass's ``__getattr__`` hook, and a plain run fires 13 events per batch. Each field is named after its
    event's value, which the Engine checks when it builds one.
    """

    before_dataloader: Firing
    after_dataloader: Firing
    batch_start: Firing
    before_train_batch: Firing
    before_forward: Firing
    after_forward: Firing
    before_loss: Firing
    after_loss: Firing
    before_backward: Firing
    after_backward: Firing
    after_train_batch: Firing
    batch_end: Firing
    batch_checkpoint: Firing


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
        #: ``fire.before_forward()`` is ``run_event(Event.BEFORE_FORWARD)`` for the per-batch path, at no Python call
        #: for an event nothing listens to.
        self.fire = BatchEvents(
            **{field.name: self._firing(Event(field.name)) for field in dataclasses.fields(BatchEvents)}
        )

    def listens_to(self, event: Event) -> bool:
        """Whether an algorithm or callback runs at ``event``: fixed once the engine is built."""
        return event in self._work

    def _firing(self, event: Event) -> Firing:
        return functools.partial(self.run_event, event) if event in self._work else _IDLE

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
