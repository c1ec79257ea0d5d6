"""ColOut: drop a random fraction of the rows and columns of each image, so training sees smaller images.

``round((1 - p_row) * H)`` rows and ``round((1 - p_col) * W)`` columns are kept (at least one of each), in
their original order; the image shrinks rather than being masked, which also makes the step cheaper. With
``batch=True`` the whole batch drops the same rows and columns; with ``batch=False`` each sample draws its
own (the sizes still match). From MosaicML Composer's ColOut method (no paper; related to "Progressive
Resizing" and "CutOut").

Event: ``AFTER_DATALOADER``, on the whole batch. Inputs are ``(N, ..., H, W)``. A target tensor of the
image's size (``(N, ..., H, W)``, a segmentation mask) loses the same rows and columns, as Composer's
``resize_target="auto"`` does; ``resize_target=True`` insists on it, ``False`` leaves targets alone.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from fabric.trainer.algorithms.batch import BatchKey, check_batch_key, get_batch_item, set_batch_item
from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State


def _check_probability(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise ValueError(f"ColOut: {name}={value!r} must be a fraction in [0, 1).")
    return float(value)


def _kept_indices(samples: int, size: int, drop: float, generator: torch.Generator | None) -> torch.Tensor:
    """``(samples, kept)`` sorted random indices into ``range(size)``, the same ``kept`` for every sample."""
    kept = max(1, round((1.0 - drop) * size))
    scores = torch.rand(samples, size, generator=generator)
    return scores.topk(kept, dim=1).indices.sort(dim=1).values


def colout_batch(
    inputs: torch.Tensor,
    p_row: float = 0.15,
    p_col: float = 0.15,
    batch: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``inputs`` (``(N, ..., H, W)``) without a random ``p_row`` of its rows and ``p_col`` of its columns."""
    return colout_images_and_masks(inputs, None, p_row, p_col, batch, generator)[0]


def colout_images_and_masks(
    inputs: torch.Tensor,
    masks: torch.Tensor | None,
    p_row: float = 0.15,
    p_col: float = 0.15,
    batch: bool = True,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`colout_batch` that drops the same rows and columns from ``masks`` (``(N, ..., H, W)``, same H, W)."""
    p_row, p_col = _check_probability("p_row", p_row), _check_probability("p_col", p_col)
    if inputs.ndim < 3:
        raise ValueError(f"ColOut needs images shaped (N, ..., H, W), got a tensor of shape {tuple(inputs.shape)}.")
    height, width = inputs.shape[-2:]
    if masks is not None and (
        masks.ndim < 3 or masks.shape[0] != inputs.shape[0] or masks.shape[-2:] != (height, width)
    ):
        raise ValueError(
            f"ColOut: a target of shape {tuple(masks.shape)} is not a mask of images shaped {tuple(inputs.shape)}; "
            "it needs (N, ..., H, W) with the images' N, H and W."
        )
    draws = 1 if batch else inputs.shape[0]
    rows = _kept_indices(draws, height, p_row, generator).to(inputs.device)
    cols = _kept_indices(draws, width, p_col, generator).to(inputs.device)
    dropped_masks = None if masks is None else _drop(masks, rows, cols, batch)
    return _drop(inputs, rows, cols, batch), dropped_masks


def _drop(tensor: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, batch: bool) -> torch.Tensor:
    """``tensor`` (``(N, ..., H, W)``) with only the kept ``rows`` and ``cols`` (one draw, or one per sample)."""
    rows, cols = rows.to(tensor.device), cols.to(tensor.device)
    if batch:
        return tensor.index_select(-2, rows[0]).index_select(-1, cols[0])
    width = tensor.shape[-1]
    middle = [1] * (tensor.ndim - 3)
    row_index = rows.view(tensor.shape[0], *middle, -1, 1).expand(*tensor.shape[:-2], rows.shape[1], width)
    kept_rows = tensor.gather(-2, row_index)
    col_index = cols.view(tensor.shape[0], *middle, 1, -1).expand(*kept_rows.shape[:-1], cols.shape[1])
    return kept_rows.gather(-1, col_index)


class ColOut(Algorithm):
    """ColOut (see the module docstring)."""

    def __init__(
        self,
        p_row: float = 0.15,
        p_col: float = 0.15,
        batch: bool = True,
        resize_target: bool | str = "auto",
        input_key: BatchKey = 0,
        target_key: BatchKey = 1,
    ) -> None:
        self.p_row, self.p_col = _check_probability("p_row", p_row), _check_probability("p_col", p_col)
        if resize_target not in (True, False, "auto"):
            raise ValueError(f"ColOut: resize_target={resize_target!r} must be 'auto', True or False.")
        self.batch, self.resize_target = batch, resize_target
        self.input_key = check_batch_key("input_key", input_key)
        self.target_key = check_batch_key("target_key", target_key)

    @override
    def match(self, event: Event, state: State) -> bool:
        return event is Event.AFTER_DATALOADER

    @override
    def apply(self, event: Event, state: State, logger: Logger) -> None:
        inputs = get_batch_item(state.batch, self.input_key)
        masks = self._masks(state.batch, inputs)
        dropped, dropped_masks = colout_images_and_masks(inputs, masks, self.p_row, self.p_col, self.batch)
        state.batch = set_batch_item(state.batch, self.input_key, dropped)
        if dropped_masks is not None:
            state.batch = set_batch_item(state.batch, self.target_key, dropped_masks)

    def _masks(self, batch: Any, inputs: torch.Tensor) -> torch.Tensor | None:
        """The target if it is to lose the same rows and columns: always (True), if image-sized ('auto'), never."""
        if self.resize_target is False:
            return None
        if self.resize_target is True:
            return get_batch_item(batch, self.target_key)  # type: ignore[no-any-return]  # its shape is checked
        try:
            target = get_batch_item(batch, self.target_key)
        except (KeyError, IndexError, TypeError):  # 'auto': a batch without targets has no mask to resize
            return None
        image_sized = isinstance(target, torch.Tensor) and target.ndim >= 3 and target.shape[-2:] == inputs.shape[-2:]
        return target if image_sized else None

    def __repr__(self) -> str:
        return f"ColOut(p_row={self.p_row}, p_col={self.p_col}, batch={self.batch})"
