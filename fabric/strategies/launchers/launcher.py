"""The launcher interface: how ``fabric.launch()`` starts the other processes of a job."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any


class Launcher(ABC):
    """Starts the processes a strategy needs and runs ``function`` in each of them."""

    @property
    @abstractmethod
    def is_interactive_compatible(self) -> bool:
        """Whether it can be used from a notebook or REPL (no script to re-run)."""

    @property
    def runs_only_the_function(self) -> bool:
        """Whether the started processes run only the function given to ``launch`` (spawn, fork), not the rest
        of the script (re-running launchers): then ``launch()`` without a function cannot work."""
        return False

    @abstractmethod
    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``function(*args, **kwargs)`` in every process; return rank 0's result to the caller."""
