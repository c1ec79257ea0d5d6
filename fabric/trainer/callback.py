"""``Callback``: code that observes the training loop, with one method per event.

Override the methods named after the events you care about (``batch_end``, ``fit_start``, ...); each
receives ``(state, logger)``. The engine precomputes which events a callback overrides and calls only
those, so an unused hook costs nothing. Overriding :meth:`Callback.run_event` instead receives every
event.
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
