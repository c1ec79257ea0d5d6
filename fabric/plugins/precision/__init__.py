"""Precision plugins. Classes load on first use; the registry and the parser are light."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric.plugins.precision.registry import PRECISION_REGISTRY, parse_precision
from fabric.utilities.lazy import lazy_exports

if TYPE_CHECKING:
    from fabric.plugins.precision.double import DoublePrecision
    from fabric.plugins.precision.half import HalfPrecision
    from fabric.plugins.precision.mixed import MixedPrecision
    from fabric.plugins.precision.precision import Precision

__all__ = ["PRECISION_REGISTRY", "DoublePrecision", "HalfPrecision", "MixedPrecision", "Precision", "parse_precision"]
__getattr__ = lazy_exports(
    __name__,
    {
        "DoublePrecision": "fabric.plugins.precision.double",
        "HalfPrecision": "fabric.plugins.precision.half",
        "MixedPrecision": "fabric.plugins.precision.mixed",
        "Precision": "fabric.plugins.precision.precision",
    },
)
