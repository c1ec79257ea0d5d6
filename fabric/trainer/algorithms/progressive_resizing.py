"""Progressive resizing: train on downscaled images first and grow them to full size, saving early compute.

The scale is ``initial_scale`` until ``delay_fraction`` of training, then grows linearly to 1 at
``1 - finetune_fraction``, and stays at 1 for the final ``finetune_fraction``. Each side becomes
``floor(scale * side / size_increment) * size_increment`` pixels (at least ``size_increment``), by bilinear
resizing (``mode="resize"``) or by a random crop (``mode="crop"``); with ``resize_targets=True`` the targets
(e.g. segmentation masks) are resized the same way (nearest neighbour) or cropped at the same place. From
"Fast.ai DAWNBench" (Howard, 2018) and "Budgeted Training" (Li et al., ICLR 2020); schedule as in Composer.

Event: ``AFTER_DATALOADER``, on the whole batch. Inputs are ``(N, C, H, W)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from typing_extensions import override

from fabric.trainer.algorithms.batch import BatchKey, check_batch_key, get_batch_item, set_batch_item
from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State

MODES = ("resize", "crop")


def resize_scale(elapsed: float, initial_scale: float, delay_fraction: float, finetune_fraction: float) -> float:
    """The image scale after ``elapsed`` (fraction) of training; see the module docstring."""
    if elapsed < delay_fraction:
        return initial_scale
    if elapsed >= 1.0 - finetune_fraction:
        return 1.0
    progress = (elapsed - delay_fraction) / (1.0 - finetune_fraction - delay_fraction)
    return initial_scale + (1.0 - initial_scale) * progress


def scaled_side(side: int, scale: float, size_increment: int) -> int:
    """``side`` scaled, rounded down to a multiple of ``size_increment``, kept within ``[size_increment, side]``."""
    return min(side, max(size_increment, math.floor(scale * side / size_increment) * size_increment))


def resize_batch(
    inputs: torch.Tensor,
    targets: torch.Tensor | None,
    scale: float,
    mode: str = "resize",
    size_increment: int = 4,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(inputs, targets)`` shrunk to ``scale``; ``targets`` (None to leave alone) must share the inputs' H and W."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not supported; use one of {', '.join(MODES)}.")
    if inputs.ndim != 4:
        raise ValueError(f"Progressive resizing needs (N, C, H, W) inputs, got shape {tuple(inputs.shape)}.")
    height, width = inputs.shape[-2:]
    new_height, new_width = scaled_side(height, scale, size_increment), scaled_side(width, scale, size_increment)
    if (new_height, new_width) == (height, width):
        return inputs, targets
    if mode == "crop":
        top = int(torch.randint(0, height - new_height + 1, (1,), generator=generator).item())
        left = int(torch.randint(0, width - new_width + 1, (1,), generator=generator).item())
        crop = (..., slice(top, top + new_height), slice(left, left + new_width))
        return inputs[crop], None if targets is None else targets[crop]
    resized = F.interpolate(inputs, size=(new_height, new_width), mode="bilinear", align_corners=False)
    if targets is None:
        return resized, None
    # Nearest keeps class ids intact; interpolate needs a channel dimension and a float tensor.
    as_image = targets.unsqueeze(1) if targets.ndim == 3 else targets
    resized_targets = F.interpolate(as_image.float(), size=(new_height, new_width), mode="nearest")
    resized_targets = resized_targets.squeeze(1) if targets.ndim == 3 else resized_targets
    return resized, resized_targets.to(targets.dtype)


class ProgressiveResizing(Algorithm):
    """Progressive resizing (see the module docstring)."""

    def __init__(
        self,
        initial_scale: float = 0.5,
        finetune_fraction: float = 0.2,
        delay_fraction: float = 0.5,
        size_increment: int = 4,
        resize_targets: bool = False,
        mode: str = "resize",
        input_key: BatchKey = 0,
        target_key: BatchKey = 1,
    ) -> None:
        if isinstance(initial_scale, bool) or not isinstance(initial_scale, int | float) or not 0 < initial_scale <= 1:
            raise ValueError(f"ProgressiveResizing: initial_scale={initial_scale!r} must be in (0, 1].")
        for name, fraction in (("finetune_fraction", finetune_fraction), ("delay_fraction", delay_fraction)):
            if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 <= fraction <= 1:
                raise ValueError(f"ProgressiveResizing: {name}={fraction!r} must be in [0, 1].")
        if delay_fraction + finetune_fraction > 1:
            raise ValueError(
                f"ProgressiveResizing: delay_fraction + finetune_fraction = {delay_fraction + finetune_fraction} "
                "must be at most 1."
            )
        if isinstance(size_increment, bool) or not isinstance(size_increment, int) or size_increment < 1:
            raise ValueError(f"ProgressiveResizing: size_increment={size_increment!r} must be an int of at least 1.")
        if mode not in MODES:
            raise ValueError(f"ProgressiveResizing: mode={mode!r} is not supported; use one of {', '.join(MODES)}.")
        self.initial_scale, self.finetune_fraction, self.delay_fraction = (
            initial_scale,
            finetune_fraction,
            delay_fraction,
        )
        self.size_increment, self.resize_targets, self.mode = size_increment, resize_targets, mode
        self.input_key = check_batch_key("input_key", input_key)
        self.target_key = check_batch_key("target_key", target_key)

    @override
    def match(self, event: Event, state: State) -> bool:
        return event is Event.AFTER_DATALOADER

    @override
    def apply(self, event: Event, state: State, logger: Logger) -> None:
        scale = resize_scale(
            float(state.get_elapsed_duration()), self.initial_scale, self.delay_fraction, self.finetune_fraction
        )
        inputs = get_batch_item(state.batch, self.input_key)
        targets = get_batch_item(state.batch, self.target_key) if self.resize_targets else None
        new_inputs, new_targets = resize_batch(inputs, targets, scale, self.mode, self.size_increment)
        state.batch = set_batch_item(state.batch, self.input_key, new_inputs)
        if new_targets is not None:
            state.batch = set_batch_item(state.batch, self.target_key, new_targets)
        if logger is not None:
            logger.log_metrics({"progressive_resizing/scale": scale})

    def __repr__(self) -> str:
        return f"ProgressiveResizing(initial_scale={self.initial_scale}, mode={self.mode!r})"
