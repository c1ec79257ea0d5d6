"""A programmatic accelerator layer for PyTorch: keep your loop, get devices, precision and scale.

``import fabric`` is cheap: the public names below load on first use (PEP 562), so the CLI and
``--help`` never pay for torch, and optional backends never load unless chosen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric.utilities import moved_modules
from fabric.utilities.lazy import lazy_exports
from fabric.utilities.name_clash import DISTRIBUTION, refuse_mixed_install

if TYPE_CHECKING:
    from fabric.fabric import Fabric
    from fabric.utilities.seed import seed_everything

__version__ = "0.1.0"
#: Tells this package from others imported as ``fabric`` (the SSH library Fabric): see fabric.utilities.name_clash.
__distribution__ = DISTRIBUTION
__all__ = ["Fabric", "__version__", "seed_everything"]
__getattr__ = lazy_exports(__name__, {"Fabric": "fabric.fabric", "seed_everything": "fabric.utilities.seed"})

refuse_mixed_install(__path__[0])
moved_modules.install()  # old import paths of moved modules still work, with a warning naming the new one
