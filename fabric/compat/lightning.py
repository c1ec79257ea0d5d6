"""``python -m fabric.compat.lightning [-m MODULE | SCRIPT] [ARGS ...]``: run a program written for Lightning
Fabric, unchanged, with this project answering its ``lightning.fabric`` imports and ``L.Fabric``.

Opt-in, for this process and the ranks it launches (``fabric.launch()`` starts them with the same command line);
never on by default. With Lightning installed, its modules are imported as they are and this project's names are
set on them (:func:`fabric.compat.aliases.overlay`): ``lightning.pytorch``, ``LightningModule``,
``LightningDataModule`` and Lightning's loggers stay Lightning's. Without it, ``lightning`` and ``lightning.fabric``
are served from the table alone, and Lightning's own parts are refused by name. Which name comes from where is
:mod:`fabric.compat.lightning_names`.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

from fabric.compat.aliases import install_finder, overlay
from fabric.compat.lightning_names import LIGHTNING_FABRIC, LIGHTNING_OWN_NAMES
from fabric.compat.runner import run_in_mode

_enabled: list[str] = []  # how it was switched on in this process, once


def enable() -> str:
    """Switch the drop-in mode on in this process: ``"overlay"`` where Lightning is installed, else ``"alias"``."""
    if _enabled:
        return _enabled[0]
    if "lightning" in sys.modules or importlib.util.find_spec("lightning") is not None:
        import lightning  # noqa: F401 - Lightning as it is: lightning.pytorch binds its own lightning.fabric

        overlay(LIGHTNING_FABRIC, keep={"lightning": LIGHTNING_OWN_NAMES})
        _enabled.append("overlay")
    else:
        install_finder(LIGHTNING_FABRIC, roots=("lightning",))
        _enabled.append("alias")
    return _enabled[0]


def main(argv: Sequence[str] | None = None) -> None:
    """Enable the drop-in mode, then run ``-m MODULE`` or ``SCRIPT`` as ``__main__`` with the remaining arguments."""
    run_in_mode("fabric.compat.lightning", enable, argv)


if __name__ == "__main__":
    main()
