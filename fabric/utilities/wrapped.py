"""Telling the objects ``fabric.setup*`` returned from the user's own: :func:`is_wrapped`.

The wrappers live in a higher layer (:mod:`fabric.wrappers`); they all derive from the marker class
:class:`SetUpByFabric` defined here, so this check imports nothing.
"""

from __future__ import annotations

from typing import Any

from fabric.utilities.compile import uncompiled


class SetUpByFabric:
    """Marker base of the module, optimizer and dataloader wrappers that ``fabric.setup*`` return."""

    __slots__ = ()


def is_wrapped(obj: Any) -> bool:
    """Whether ``obj`` was returned by ``fabric.setup``, ``setup_module``, ``setup_optimizers`` or
    ``setup_dataloaders`` (also when it was passed through ``torch.compile`` afterwards)."""
    original, _ = uncompiled(obj)
    return isinstance(original, SetUpByFabric)
