"""``NaNMonitor``: fail fast, naming the batch, as soon as the loss is NaN or infinite."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from fabric.trainer.core.callback import Callback

if TYPE_CHECKING:
    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State


class NaNMonitor(Callback):
    """Raises ``RuntimeError`` right after a loss that is not finite is computed.

    Checks every microbatch's loss (a tensor, a number, or a dict/list/tuple of them). Reading the
    value synchronizes with the device once per microbatch, the price of stopping at the bad batch
    rather than training on garbage for hours.
    """

    @override
    def after_loss(self, state: State, logger: Logger) -> None:
        if not _is_finite(state.loss):
            raise RuntimeError(
                f"The loss is not finite at batch index {int(state.timestamp.batch)} "
                f"(epoch {int(state.timestamp.epoch)}): {state.loss!r}."
            )


def _is_finite(loss: Any) -> bool:
    if isinstance(loss, torch.Tensor):
        return bool(torch.isfinite(loss).all())
    if isinstance(loss, Mapping):
        return all(_is_finite(value) for value in loss.values())
    if isinstance(loss, Sequence) and not isinstance(loss, str):
        return all(_is_finite(value) for value in loss)
    return math.isfinite(loss)
