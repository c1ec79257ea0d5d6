"""Running a program as ``__main__`` in a drop-in mode: ``python -m fabric.compat.NAME (-m MODULE | SCRIPT) ARGS``.

The mode is switched on first (``enable``), then the module or script runs with ``sys.argv`` as it would have had
under ``python -m MODULE ARGS`` or ``python SCRIPT ARGS``. The ranks ``fabric.launch()`` starts run the same command
line, so they are in the mode too.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Callable, Sequence


def run_in_mode(runner: str, enable: Callable[[], object], argv: Sequence[str] | None = None) -> None:
    """Enable the mode, then run ``-m MODULE`` or ``SCRIPT`` from ``argv`` (default: ``sys.argv[1:]``) as
    ``__main__`` with the remaining arguments; without a program, print the usage of ``python -m runner``."""
    usage = f"usage: python -m {runner} (-m MODULE | SCRIPT) [ARGS ...]"
    arguments = list(sys.argv[1:] if argv is None else argv)
    if not arguments or arguments[0] in ("-h", "--help") or arguments == ["-m"]:
        print(usage, file=sys.stderr if not arguments or arguments == ["-m"] else sys.stdout)
        raise SystemExit(0 if arguments and arguments[0] in ("-h", "--help") else 2)
    enable()
    if arguments[0] == "-m":
        sys.argv = [arguments[1], *arguments[2:]]
        runpy.run_module(arguments[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = arguments
        runpy.run_path(arguments[0], run_name="__main__")
