"""``Callback``: code that observes the training loop, with one method per event.

Override the methods named after the events you care about (``batch_end``, ``fit_start``, ...); each
receives ``(state, logger)``. The engine precomputes which events a callback overrides and calls only
those, so an unused hook costs nothing. Overriding :meth:`Callback.run_event` instead receives every
event. The hooks, in the order they fire (see :mod:`fabric.trainer.events` for where)::

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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fabric.trainer.events import Event

if TYPE_CHECKING:
    from fabric.trainer.state import State


class Callback:
    """Base class of callbacks; every per-event method is a no-op until overridden."""

    def run_event(self, event: Event, state: State, logger: Any) -> None:
        """Called for every event when overridden; by default dispatches to the event's method."""
        getattr(self, event.value)(state, logger)

    def close(self, state: State, logger: Any) -> None:
        """Called once by ``Trainer.close()``, before any callback's :meth:`post_close`."""

    def post_close(self) -> None:
        """Called once by ``Trainer.close()``, after every callback's :meth:`close`."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""

    def handlers(self) -> dict[Event, Any]:
        """The bound methods to call per event: only the ones this callback's class overrides."""
        if type(self).run_event is not Callback.run_event:
            return {event: _every_event(self, event) for event in Event}
        return {
            event: getattr(self, event.value)
            for event in Event
            if getattr(type(self), event.value) is not getattr(Callback, event.value)
        }


def _every_event(callback: Callback, event: Event) -> Any:
    def handler(state: State, logger: Any) -> None:
        callback.run_event(event, state, logger)

    return handler


def _no_op(self: Callback, state: State, logger: Any) -> None:
    """Does nothing until a subclass overrides it."""


for _event in Event:  # one no-op method per event, named after it (``batch_end``, ...)
    setattr(Callback, _event.value, _no_op)
