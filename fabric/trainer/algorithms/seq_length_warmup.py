"""Sequence length warmup: train language models on short sequences first, growing them to full length.

The length grows linearly from ``min_seq_length`` to ``max_seq_length`` over the first ``duration`` of
training, rounded down to a multiple of ``step_size`` (never below ``min_seq_length``), then stays at the
maximum. Every tensor of a dict batch shaped like ``input_ids`` (``attention_mask``, ``labels``, ...) is
changed alike: cut to the length (``truncate=True``), or reshaped into more, shorter sequences so no token is
wasted (``truncate=False``; a remainder shorter than the length is dropped). From "Curriculum Learning: A
Regularization Method for Efficient and Stable Billion-Scale GPT Model Pre-Training" (Li et al., 2021);
named as in Composer. No Hugging Face dependency: any mapping with an ``input_ids`` tensor works.

Event: ``AFTER_DATALOADER``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from typing_extensions import override

from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State


def warmup_length(elapsed: float, duration: float, min_seq_length: int, max_seq_length: int, step_size: int) -> int:
    """The sequence length after ``elapsed`` (fraction of training); see the module docstring."""
    progress = min(elapsed / duration, 1.0)
    length = min_seq_length + (max_seq_length - min_seq_length) * progress
    return min(max(int(length // step_size) * step_size, min_seq_length), max_seq_length)


def set_batch_sequence_length(batch: Mapping[str, Any], length: int, truncate: bool = True) -> Mapping[str, Any]:
    """``batch`` (a mapping with ``input_ids`` of shape ``(N, S)``), every ``(N, S, ...)`` tensor cut or reshaped."""
    if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), torch.Tensor):
        raise TypeError(f"Sequence length warmup needs a mapping batch with an 'input_ids' tensor, got {type(batch)}.")
    shape = batch["input_ids"].shape[:2]
    if length >= shape[1]:
        return batch
    changed = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.shape[:2] == shape:
            if truncate:
                changed[key] = value[:, :length]
            else:
                whole = shape[1] // length * length
                changed[key] = value[:, :whole].reshape(-1, length, *value.shape[2:])
    return type(batch)({**batch, **changed})  # type: ignore[call-arg]


class SeqLengthWarmup(Algorithm):
    """Sequence length warmup (see the module docstring)."""

    def __init__(
        self,
        duration: float = 0.3,
        min_seq_length: int = 8,
        max_seq_length: int = 1024,
        step_size: int = 8,
        truncate: bool = True,
    ) -> None:
        if isinstance(duration, bool) or not isinstance(duration, int | float) or not 0 < duration <= 1:
            raise ValueError(f"SeqLengthWarmup: duration={duration!r} must be a fraction of training in (0, 1].")
        for name, count in (
            ("min_seq_length", min_seq_length),
            ("max_seq_length", max_seq_length),
            ("step_size", step_size),
        ):
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"SeqLengthWarmup: {name}={count!r} must be an int of at least 1.")
        if min_seq_length > max_seq_length:
            raise ValueError(
                f"SeqLengthWarmup: min_seq_length={min_seq_length} must not exceed max_seq_length={max_seq_length}."
            )
        self.duration, self.min_seq_length, self.max_seq_length = duration, min_seq_length, max_seq_length
        self.step_size, self.truncate = step_size, truncate

    @override
    def match(self, event: Event, state: State) -> bool:
        return event is Event.AFTER_DATALOADER

    @override
    def apply(self, event: Event, state: State, logger: Logger) -> None:
        length = warmup_length(
            float(state.get_elapsed_duration()), self.duration, self.min_seq_length, self.max_seq_length, self.step_size
        )
        state.batch = set_batch_sequence_length(state.batch, length, self.truncate)
        if logger is not None:
            logger.log_metrics({"seq_length_warmup/length": length})

    def __repr__(self) -> str:
        return f"SeqLengthWarmup(duration={self.duration}, min={self.min_seq_length}, max={self.max_seq_length})"
