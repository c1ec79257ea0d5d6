"""Algorithm passes: plain functions that decide the order algorithms run in at an event.

A pass takes the algorithms (in their current order) and the event, and returns them reordered. The
engine applies :data:`DEFAULT_PASSES` in sequence; users may pass their own list.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.events import Event
from fabric.trainer.surgery import SurgeryAlgorithm

AlgorithmPass = Callable[[Sequence[Algorithm], Event], list[Algorithm]]


def reverse_on_closing_events(algorithms: Sequence[Algorithm], event: Event) -> list[Algorithm]:
    """First in, last out: at ``AFTER_*``/``*_END`` events run algorithms in reverse, so an algorithm
    that changed something at the opening event undoes it after the ones applied on top of it."""
    return list(reversed(algorithms)) if event.is_after else list(algorithms)


def layout_after_structure(algorithms: Sequence[Algorithm], event: Event) -> list[Algorithm]:
    """At INIT, surgery that only changes memory layout (ChannelsLast) runs after surgery that changes
    modules, so the modules the others create (BlurPool's blurs, Factorize's pairs) get the layout too."""
    if event != Event.INIT:
        return list(algorithms)
    layout_only = [a for a in algorithms if isinstance(a, SurgeryAlgorithm) and not a.changes_module_structure]
    return [a for a in algorithms if a not in layout_only] + layout_only


def sort_to_front(*types: type[Algorithm]) -> AlgorithmPass:
    """A pass that moves instances of ``types`` to the front (in the given order), keeping the rest."""

    def apply(algorithms: Sequence[Algorithm], event: Event) -> list[Algorithm]:
        front = [a for kind in types for a in algorithms if type(a) is kind]
        return front + [a for a in algorithms if a not in front]

    return apply


DEFAULT_PASSES: tuple[AlgorithmPass, ...] = (reverse_on_closing_events, layout_after_structure)


def check_compatibility(algorithms: Sequence[Algorithm]) -> None:
    """Raise for combinations that cannot work, at construction rather than mid-training."""
    seen: dict[type[Algorithm], Algorithm] = {}
    for algorithm in algorithms:
        kind = type(algorithm)
        if kind in seen and not kind.allow_multiple_instances:
            raise ValueError(
                f"Two {kind.__name__} instances were given; {kind.__name__} can run only once (see its "
                "allow_multiple_instances)."
            )
        seen[kind] = algorithm
    for algorithm in algorithms:
        clashes = [other for other in algorithms if isinstance(other, type(algorithm).incompatible_with)]
        if clashes:
            kind = type(algorithm)
            reason = kind.incompatibility_reason or f"see {kind.__name__}'s documentation"
            raise ValueError(
                f"{kind.__name__} cannot run together with {type(clashes[0]).__name__}: {reason}. Remove one of them."
            )
