"""Skip weight initialisation while building a module whose weights a checkpoint will overwrite."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch.overrides import TorchFunctionMode


class SkipParameterInit(TorchFunctionMode):
    """Turns every ``torch.nn.init`` function into a no-op, leaving parameters uninitialised.

    Saves the (often dominant) time spent initialising a large model that is about to be loaded from a
    checkpoint. The parameters hold arbitrary memory until then, so only use it before a load.
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs.get("tensor") if kwargs else None
        return func(*args, **(kwargs or {}))
