"""Fabric internals shared by every layer: registries, parsers, collection helpers; and :func:`is_wrapped`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric.utilities.lazy import lazy_exports

if TYPE_CHECKING:
    from fabric.utilities.wrapped import is_wrapped

__all__ = ["is_wrapped"]
__getattr__ = lazy_exports(__name__, {"is_wrapped": "fabric.utilities.wrapped"})
