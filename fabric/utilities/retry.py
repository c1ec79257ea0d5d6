"""``retry``: call a function again when it raises a given exception, with exponential backoff and jitter
(Composer's ``composer.utils.retry``, which llm-foundry uses around downloads and uploads)."""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

_Function = TypeVar("_Function", bound=Callable[..., Any])


def retry(
    exc_class: type[BaseException] | Sequence[type[BaseException]],
    num_attempts: int = 3,
    initial_backoff: float = 1.0,
    max_jitter: float = 0.5,
) -> Callable[[_Function], _Function]:
    """Decorate a function so that a raised ``exc_class`` calls it again, up to ``num_attempts`` calls in all; the
    last attempt's exception propagates. Before attempt ``n + 1`` it waits ``initial_backoff * 2**n`` seconds plus a
    random jitter of up to ``max_jitter``. Other exceptions propagate at once."""
    caught = tuple(exc_class) if isinstance(exc_class, Sequence) else (exc_class,)
    if isinstance(num_attempts, bool) or not isinstance(num_attempts, int) or num_attempts < 1:
        raise ValueError(f"retry(num_attempts={num_attempts!r}) must be a whole number, at least 1.")
    if initial_backoff < 0 or max_jitter < 0:
        raise ValueError(f"retry: initial_backoff={initial_backoff} and max_jitter={max_jitter} cannot be negative.")

    def decorate(function: _Function) -> _Function:
        @functools.wraps(function)
        def attempt(*args: Any, **kwargs: Any) -> Any:
            for number in range(num_attempts - 1):
                try:
                    return function(*args, **kwargs)
                except caught:
                    time.sleep(initial_backoff * 2**number + random.random() * max_jitter)
            return function(*args, **kwargs)  # the last attempt: its exception propagates

        return attempt  # type: ignore[return-value]

    return decorate
