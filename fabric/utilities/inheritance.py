"""Which methods a subclass left as its base wrote them: lets a base skip its own no-op hooks on the per-step path."""

from __future__ import annotations


def inherits_unchanged(cls: type, base: type, *names: str) -> bool:
    """Whether ``cls`` overrides none of ``names`` that it inherits from ``base``.

    Decided per class, when the class is created (``__init_subclass__``); a method patched onto an instance later is
    not seen, so hooks are changed by subclassing.
    """
    return all(getattr(cls, name) is getattr(base, name) for name in names)
