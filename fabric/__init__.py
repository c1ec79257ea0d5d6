"""A programmatic accelerator layer for PyTorch: keep your loop, get devices, precision and scale.

``import fabric`` is cheap: the public names below load on first use (PEP 562), so the CLI and
``--help`` never pay for torch, and optional backends never load unless chosen.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fabric.fabric import Fabric
    from fabric.utilities.seed import seed_everything

__version__ = "0.1.0"

_LAZY_ATTRIBUTES = {
    "Fabric": "fabric.fabric",
    "seed_everything": "fabric.utilities.seed",
}

__all__ = ["Fabric", "__version__", "seed_everything"]


def __getattr__(name: str) -> Any:
    if name in _LAZY_ATTRIBUTES:
        value = getattr(importlib.import_module(_LAZY_ATTRIBUTES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fabric' has no attribute {name!r}")
