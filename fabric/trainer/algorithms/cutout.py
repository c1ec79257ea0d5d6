"""CutOut: zero random square patches of each image, so the model cannot rely on any one region.

Each sample gets ``num_holes`` squares of side ``length`` (pixels if an int >= 1, a fraction of the image's
shorter side if a float in (0, 1)), centred at uniformly random pixels and clipped at the borders; holes may
overlap. From "Improved Regularization of Convolutional Neural Networks with Cutout" (DeVries & Taylor, 2017).

Event: ``AFTER_DATALOADER``, on the whole batch, so every microbatch and every later algorithm sees the holes.
Inputs are ``(N, ..., H, W)``; every channel of a pixel is zeroed.
"""

from __future__ import annotations

import torch
from typing_extensions import override

from fabric.trainer.algorithms.batch import BatchKey, check_batch_key, get_batch_item, set_batch_item
from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State


def _check_holes(num_holes: int, length: float) -> None:
    if isinstance(num_holes, bool) or not isinstance(num_holes, int) or num_holes < 1:
        raise ValueError(f"CutOut: num_holes={num_holes!r} must be an int of at least 1.")
    if isinstance(length, bool) or not isinstance(length, int | float) or length <= 0:
        raise ValueError(f"CutOut: length={length!r} must be a fraction in (0, 1) or a whole number of pixels >= 1.")
    if length >= 1 and length != int(length):
        raise ValueError(f"CutOut: length={length!r} is not a fraction in (0, 1), so it must be a whole pixel count.")


def cutout_mask(
    batch_size: int, height: int, width: int, num_holes: int, side: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """A boolean ``(batch_size, height, width)`` mask, False inside each sample's ``num_holes`` random squares."""
    centers_y = torch.randint(0, height, (batch_size, num_holes, 1), generator=generator)
    centers_x = torch.randint(0, width, (batch_size, num_holes, 1), generator=generator)
    rows, cols = torch.arange(height), torch.arange(width)
    in_rows = (rows >= centers_y - side // 2) & (rows < centers_y - side // 2 + side)  # (N, holes, H)
    in_cols = (cols >= centers_x - side // 2) & (cols < centers_x - side // 2 + side)  # (N, holes, W)
    return ~(in_rows[..., :, None] & in_cols[..., None, :]).any(dim=1)


def cutout_batch(
    inputs: torch.Tensor, num_holes: int = 1, length: float = 0.5, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``inputs`` (``(N, ..., H, W)``) with ``num_holes`` random squares of side ``length`` zeroed per sample."""
    _check_holes(num_holes, length)
    if inputs.ndim < 3:
        raise ValueError(f"CutOut needs images shaped (N, ..., H, W), got a tensor of shape {tuple(inputs.shape)}.")
    height, width = inputs.shape[-2:]
    side = max(1, int(length * min(height, width))) if length < 1 else int(length)
    mask = cutout_mask(inputs.shape[0], height, width, num_holes, side, generator).to(inputs.device)
    mask = mask.view(inputs.shape[0], *([1] * (inputs.ndim - 3)), height, width)
    return inputs * mask


class CutOut(Algorithm):
    """CutOut (see the module docstring)."""

    def __init__(self, num_holes: int = 1, length: float = 0.5, input_key: BatchKey = 0) -> None:
        _check_holes(num_holes, length)
        self.num_holes, self.length = num_holes, length
        self.input_key = check_batch_key("input_key", input_key)

    @override
    def match(self, event: Event, state: State) -> bool:
        return event is Event.AFTER_DATALOADER

    @override
    def apply(self, event: Event, state: State, logger: Logger) -> None:
        inputs = get_batch_item(state.batch, self.input_key)
        state.batch = set_batch_item(state.batch, self.input_key, cutout_batch(inputs, self.num_holes, self.length))

    def __repr__(self) -> str:
        return f"CutOut(num_holes={self.num_holes}, length={self.length})"
