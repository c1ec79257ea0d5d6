"""Fabric internals shared by every layer: registries, parsers, collection helpers; and :func:`is_wrapped`,
:func:`measure_flops`, :class:`Throughput` and :class:`ThroughputMonitor`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric.utilities.lazy import lazy_exports

if TYPE_CHECKING:
    from fabric.utilities.throughput import Throughput, ThroughputMonitor, measure_flops
    from fabric.utilities.wrapped import is_wrapped

__all__ = ["Throughput", "ThroughputMonitor", "is_wrapped", "measure_flops"]
__getattr__ = lazy_exports(
    __name__,
    {
        "is_wrapped": "fabric.utilities.wrapped",
        "measure_flops": "fabric.utilities.throughput",
        "Throughput": "fabric.utilities.throughput",
        "ThroughputMonitor": "fabric.utilities.throughput",
    },
)
