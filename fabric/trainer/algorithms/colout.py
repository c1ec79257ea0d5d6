"""ColOut: drop a random fraction of the rows and columns of each image, so training sees smaller images.

``round((1 - p_row) * H)`` rows and ``round((1 - p_col) * W)`` columns are kept (at least one of each), in
their original order; the image shrinks rather than being masked, which also makes the step cheaper. With
``batch=True`` the whole batch drops the same rows and columns; with ``batch=False`` each sample draws its
own (the sizes still match). From MosaicML Composer's ColOut method (no paper; related to "Progressive
Resizing" and "CutOut").

Event: ``AFTER_DATALOADER``, on the whole batch. Inputs are ``(N, ..., H, W)``; targets are not changed.
"""

from __future__ import annotations

from typing import Any

import torch

from fabric.trainer.algorithm import Algorithm
from fabric.trainer.algorithms.batch import BatchKey, check_batch_key, get_batch_item, set_batch_item
from fabric.trainer.events import Event
from fabric.trainer.state import State


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
    p_row, p_col = _check_probability("p_row", p_row), _check_probability("p_col", p_col)
    if inputs.ndim < 3:
        raise ValueError(f"ColOut needs images shaped (N, ..., H, W), got a tensor of shape {tuple(inputs.shape)}.")
    height, width = inputs.shape[-2:]
    draws = 1 if batch else inputs.shape[0]
    rows = _kept_indices(draws, height, p_row, generator).to(inputs.device)
    cols = _kept_indices(draws, width, p_col, generator).to(inputs.device)
    if batch:
        return inputs.index_select(-2, rows[0]).index_select(-1, cols[0])
    middle = [1] * (inputs.ndim - 3)
    row_index = rows.view(inputs.shape[0], *middle, -1, 1).expand(*inputs.shape[:-2], rows.shape[1], width)
    kept_rows = inputs.gather(-2, row_index)
    col_index = cols.view(inputs.shape[0], *middle, 1, -1).expand(*kept_rows.shape[:-1], cols.shape[1])
    return kept_rows.gather(-1, col_index)


class ColOut(Algorithm):
    """ColOut (see the module docstring)."""

    def __init__(self, p_row: float = 0.15, p_col: float = 0.15, batch: bool = True, input_key: BatchKey = 0) -> None:
        self.p_row, self.p_col = _check_probability("p_row", p_row), _check_probability("p_col", p_col)
        self.batch = batch
        self.input_key = check_batch_key("input_key", input_key)

    def match(self, event: Event, state: State) -> bool:
        return event is Event.AFTER_DATALOADER

    def apply(self, event: Event, state: State, logger: Any) -> None:
        inputs = get_batch_item(state.batch, self.input_key)
        dropped = colout_batch(inputs, self.p_row, self.p_col, self.batch)
        state.batch = set_batch_item(state.batch, self.input_key, dropped)

    def __repr__(self) -> str:
        return f"ColOut(p_row={self.p_row}, p_col={self.p_col}, batch={self.batch})"
