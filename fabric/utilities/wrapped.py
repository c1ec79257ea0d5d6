"""Telling the objects ``fabric.setup*`` returned from the user's own: :func:`is_wrapped`.

The wrappers live in a higher layer (:mod:`fabric.wrappers`); they all derive from the marker class
:class:`SetUpByFabric` defined here, so this check imports nothing.
"""

from __future__ import annotations

import sys
from typing import Any


class SetUpByFabric:
    """Marker base of the module, optimizer and dataloader wrappers that ``fabric.setup*`` return."""

    __slots__ = ()


def is_wrapped(obj: Any) -> bool:
    """Whether ``obj`` was returned by ``fabric.setup``, ``setup_module``, ``setup_optimizers`` or
    ``setup_dataloaders`` (also when it was passed through ``torch.compile`` afterwards)."""
    dynamo = sys.modules.get("torch._dynamo")  # a compiled module implies torch._dynamo is loaded
    if dynamo is not None and isinstance(obj, dynamo.OptimizedModule):
        obj = obj._orig_mod
    return isinstance(obj, SetUpByFabric)
