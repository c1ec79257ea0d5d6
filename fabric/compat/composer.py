"""``python -m fabric.compat.composer [-m MODULE | SCRIPT] [ARGS ...]``: run a program written for Composer,
unchanged, with this project answering its ``composer`` imports (the Trainer, its events, algorithms, callbacks,
loggers, schedulers, metrics and profiler keep Composer's names here).

Opt-in, for this process and the ranks it launches; never on by default. Composer does not install beside torch 2.13,
so ``composer`` and its modules are always served from the table (:mod:`fabric.compat.composer_names`); a name with
no counterpart raises one line saying what to use instead, when it is used. ``fabric run model --drop-in=composer``
does the same with the ranks started by the CLI (Composer's launcher flags ``-n``, ``--world_size``, ... are taken
there).
"""

from __future__ import annotations

from collections.abc import Sequence

from fabric.compat.aliases import install_finder
from fabric.compat.composer_names import COMPOSER
from fabric.compat.runner import run_in_mode

_enabled: list[bool] = []  # switched on in this process, once


def enable() -> None:
    """Switch the Composer drop-in mode on in this process."""
    if not _enabled:
        install_finder(COMPOSER, roots=("composer",))
        _enabled.append(True)


def main(argv: Sequence[str] | None = None) -> None:
    """Enable the drop-in mode, then run ``-m MODULE`` or ``SCRIPT`` as ``__main__`` with the remaining arguments."""
    run_in_mode("fabric.compat.composer", enable, argv)


if __name__ == "__main__":
    main()
