"""``Callback``: code that observes the training loop, with one method per event.

Override the methods named after the events you care about (``batch_end``, ``fit_start``, ...); each
receives ``(state, logger)``. The engine precomputes which events a callback overrides and calls only
those, so an unused hook costs nothing. Overriding :meth:`Callback.run_event` instead receives every
event. The hooks, in the order they fire (see :mod:`fabric.trainer.core.events` for where)::

    init, before_load, after_load,
    fit_start, iteration_start, epoch_start,
    before_dataloader, after_dataloader, batch_start, before_train_batch,
    before_forward, after_forward, before_loss, after_loss, before_backward, after_backward,
    after_train_batch, batch_end, batch_checkpoint,
    epoch_end, epoch_checkpoint, iteration_end, iteration_checkpoint, fit_end,
    eval_before_all | eval_standalone_start, eval_start,
    eval_batch_start, eval_before_forward, eval_after_forward, eval_batch_end,
    eval_end, eval_after_all | eval_standalone_end,
    predict_start, predict_batch_start, predict_before_forward, predict_after_forward, predict_batch_end,
    predict_end

and, outside the events, ``close(state, logger)`` and ``post_close()`` from ``Trainer.close()``: every
callback's ``close`` first (flush, finish uploads), then every ``post_close`` (what must wait until all
callbacks closed).

The hook methods are written out below (``tests/trainer/core/test_events.py`` checks they match :class:`Event`
one to one), so IDEs and mypy see them. A public method that names no event, yet looks like a hook
(its name is close to an event's, or it takes ``(state, logger)``), is most likely misspelt and would
never run: :func:`warn_unknown_hooks` warns about it when the callback is registered with an engine.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

from fabric.trainer.core.events import Event
from fabric.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State

#: What runs for an event: a callback's bound hook method, called with ``(state, logger)``.
Handler: TypeAlias = "Callable[[State, Logger], None]"


@runtime_checkable
class SavesCheckpoints(Protocol):
    """A callback that writes checkpoints (the Trainer's ``CheckpointSaver``): ``saved`` lists their paths, oldest
    first. Loggers that upload checkpoints as artifacts read it, without depending on the checkpoint package."""

    saved: list[str]


class Callback:
    """Base class of callbacks; every per-event method is a no-op until overridden."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Takes and ignores any arguments, as Composer's does: subclasses pass theirs on (llm-foundry's
        ``EvalOutputLogging`` calls ``super().__init__(self, *args, **kwargs)``)."""
        del args, kwargs
        super().__init__()

    def init(self, state: State, logger: Logger) -> None:
        """Once, in Trainer construction, before Fabric sets the model up."""

    def before_load(self, state: State, logger: Logger) -> None:
        """At the end of construction (and in ``load_checkpoint()``), before a checkpoint loads."""

    def after_load(self, state: State, logger: Logger) -> None:
        """At the end of construction (and in ``load_checkpoint()``), after a checkpoint loaded."""

    def fit_start(self, state: State, logger: Logger) -> None:
        """Once per ``fit()`` call."""

    def iteration_start(self, state: State, logger: Logger) -> None:
        """Once per ``fit()`` call (one iteration per fit)."""

    def epoch_start(self, state: State, logger: Logger) -> None:
        """Per epoch (not again when ``fit()`` continues an epoch)."""

    def before_dataloader(self, state: State, logger: Logger) -> None:
        """Per batch, before fetching it."""

    def after_dataloader(self, state: State, logger: Logger) -> None:
        """Per batch, after fetching it."""

    def batch_start(self, state: State, logger: Logger) -> None:
        """Per batch."""

    def before_train_batch(self, state: State, logger: Logger) -> None:
        """Per batch, before its microbatches (per closure call with a closure optimizer)."""

    def before_forward(self, state: State, logger: Logger) -> None:
        """Per microbatch, before the forward pass."""

    def after_forward(self, state: State, logger: Logger) -> None:
        """Per microbatch, after the forward pass."""

    def before_loss(self, state: State, logger: Logger) -> None:
        """Per microbatch, before the loss."""

    def after_loss(self, state: State, logger: Logger) -> None:
        """Per microbatch, after the loss."""

    def before_backward(self, state: State, logger: Logger) -> None:
        """Per microbatch, before the backward pass."""

    def after_backward(self, state: State, logger: Logger) -> None:
        """Per microbatch, after the backward pass."""

    def after_train_batch(self, state: State, logger: Logger) -> None:
        """Per batch, once gradients are complete, before the optimizer step."""

    def batch_end(self, state: State, logger: Logger) -> None:
        """Per batch, after the step and the timestamp advanced."""

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        """Per batch, after ``batch_end`` and any evaluation."""

    def epoch_end(self, state: State, logger: Logger) -> None:
        """Per epoch, at its end."""

    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        """Per epoch, after ``epoch_end`` and any evaluation."""

    def iteration_end(self, state: State, logger: Logger) -> None:
        """Once per ``fit()`` that ends (not on preemption or errors)."""

    def iteration_checkpoint(self, state: State, logger: Logger) -> None:
        """After ``iteration_end``."""

    def fit_end(self, state: State, logger: Logger) -> None:
        """Once per ``fit()`` call, at its end."""

    def eval_before_all(self, state: State, logger: Logger) -> None:
        """Once per evaluation round during ``fit()``."""

    def eval_start(self, state: State, logger: Logger) -> None:
        """Per evaluation dataloader."""

    def eval_batch_start(self, state: State, logger: Logger) -> None:
        """Per evaluation batch."""

    def eval_before_forward(self, state: State, logger: Logger) -> None:
        """Per evaluation batch, before the forward pass."""

    def eval_after_forward(self, state: State, logger: Logger) -> None:
        """Per evaluation batch, after the forward pass."""

    def eval_batch_end(self, state: State, logger: Logger) -> None:
        """Per evaluation batch, at its end."""

    def eval_end(self, state: State, logger: Logger) -> None:
        """Per evaluation dataloader, at its end."""

    def eval_after_all(self, state: State, logger: Logger) -> None:
        """Once per evaluation round during ``fit()``, at its end."""

    def eval_standalone_start(self, state: State, logger: Logger) -> None:
        """At the start of ``Trainer.eval()``."""

    def eval_standalone_end(self, state: State, logger: Logger) -> None:
        """At the end of ``Trainer.eval()``."""

    def predict_start(self, state: State, logger: Logger) -> None:
        """Once per ``predict()`` call."""

    def predict_batch_start(self, state: State, logger: Logger) -> None:
        """Per predict batch."""

    def predict_before_forward(self, state: State, logger: Logger) -> None:
        """Per predict batch, before the forward pass."""

    def predict_after_forward(self, state: State, logger: Logger) -> None:
        """Per predict batch, after the forward pass."""

    def predict_batch_end(self, state: State, logger: Logger) -> None:
        """Per predict batch, at its end."""

    def predict_end(self, state: State, logger: Logger) -> None:
        """Once per ``predict()`` call, at its end."""

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        """Called for every event when overridden; by default dispatches to the event's method."""
        getattr(self, event.value)(state, logger)

    def close(self, state: State, logger: Logger) -> None:
        """Called once by ``Trainer.close()``, before any callback's :meth:`post_close`."""

    def post_close(self) -> None:
        """Called once by ``Trainer.close()``, after every callback's :meth:`close`."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""

    def handlers(self) -> dict[Event, Handler]:
        """The bound methods to call per event: only the ones this callback's class overrides."""
        if type(self).run_event is not Callback.run_event:
            return {event: _every_event(self, event) for event in Event}
        return {
            event: getattr(self, event.value)
            for event in Event
            if getattr(type(self), event.value) is not getattr(Callback, event.value)
        }


def _every_event(callback: Callback, event: Event) -> Handler:
    def handler(state: State, logger: Logger) -> None:
        callback.run_event(event, state, logger)

    return handler


#: Callback's public methods that are not events.
_OWN_METHODS = frozenset({"run_event", "close", "post_close", "state_dict", "load_state_dict", "handlers"})
_EVENT_NAMES = tuple(event.value for event in Event)
_checked: set[type] = set()


def warn_unknown_hooks(callback: Callback) -> None:
    """Warn, once per class, about public methods that look like hooks but name no event.

    A method looks like a hook when its name is close to an event's (``batch_ned``, ``on_fit_end``) or
    when it takes ``(state, logger)`` like a hook; the warning names it and the closest event.
    """
    cls = type(callback)
    if cls in _checked:
        return
    _checked.add(cls)
    for name, method in inspect.getmembers(cls, inspect.isfunction):
        if name.startswith("_") or name in _OWN_METHODS or name in _EVENT_NAMES:
            continue
        close = difflib.get_close_matches(name, _EVENT_NAMES, n=1, cutoff=0.75)
        if close or _takes_state_and_logger(method):
            closest = close[0] if close else difflib.get_close_matches(name, _EVENT_NAMES, n=1, cutoff=0.0)[0]
            rank_zero_warn(
                f"{cls.__name__}.{name} matches no event, so it never runs as a hook; "
                f"did you mean {closest!r}? (events: fabric.trainer.Event)"
            )


def _takes_state_and_logger(method: Callable[..., Any]) -> bool:
    try:
        parameters = list(inspect.signature(method).parameters)
    except (TypeError, ValueError):
        return False
    return parameters[1:] == ["state", "logger"]
