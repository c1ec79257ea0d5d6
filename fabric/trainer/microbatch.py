"""Split a batch into microbatches for gradient accumulation, and weigh their losses.

With ``device_train_microbatch_size=m``, a batch of ``n`` samples runs as ``ceil(n / m)`` forward and
backward passes. Each microbatch's (mean) loss is multiplied by its share of the samples, so the summed
gradients equal the gradient of the mean loss over the whole batch, also when the last microbatch is
smaller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch


def batch_size(batch: Any) -> int:
    """Samples in ``batch``: the first dimension of its first tensor (tensors, sequences, mappings, dataclasses)."""
    if (type(batch) is tuple or type(batch) is list) and batch and isinstance(batch[0], torch.Tensor):
        return int(batch[0].shape[0])  # the common batch, ``(inputs, targets)``: asked every batch
    tensor = _first_tensor(batch)
    if tensor is not None:
        return int(tensor.shape[0])
    raise TypeError(f"Cannot tell the batch size of a {type(batch).__name__}: it holds no tensor.")


def split_batch(batch: Any, microbatch_size: int) -> list[Any]:
    """``batch`` as a list of microbatches of at most ``microbatch_size`` samples, in order.

    Tensors are sliced along their first dimension (views, no copies). A list or tuple of one plain value per sample
    (numbers, strings, 0-dim tensors: llm-foundry's per-sample token counts) is sliced as the samples are; other
    values are repeated.
    """
    if microbatch_size < 1:
        raise ValueError(f"microbatch_size={microbatch_size} must be at least 1.")
    size = batch_size(batch)
    return [_slice(batch, start, min(start + microbatch_size, size), size) for start in range(0, size, microbatch_size)]


def split_list(values: Sequence[Any], microbatch_size: int) -> list[Sequence[Any]]:
    """``values`` (one per sample) in chunks of at most ``microbatch_size``, in order: Composer's ``_split_list``,
    with which llm-foundry's in-context learning datasets split their per-sample lists into eval microbatches."""
    if microbatch_size < 1:
        raise ValueError(f"microbatch_size={microbatch_size} must be at least 1.")
    return [values[start : start + microbatch_size] for start in range(0, len(values), microbatch_size)]


def loss_weight(microbatch: Any, total_samples: int) -> float:
    """The factor for a microbatch's mean loss so that the microbatches' gradients add up to the batch's."""
    return batch_size(microbatch) / total_samples


def joined_outputs(outputs: list[Any]) -> Any:
    """The microbatches' outputs as one: concatenated when all are tensors, else the list."""
    if all(isinstance(output, torch.Tensor) and output.dim() > 0 for output in outputs):
        return torch.cat(outputs)
    return outputs


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is a device or host allocation failure (what auto microbatching recovers from)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    message = str(error)
    return isinstance(error, RuntimeError) and ("out of memory" in message or "can't allocate memory" in message)


def _slice(value: Any, start: int, stop: int, size: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value[start:stop]
    if isinstance(value, Mapping):
        return type(value)({key: _slice(item, start, stop, size) for key, item in value.items()})  # type: ignore[call-arg]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return dataclasses.replace(value, **{f.name: _slice(getattr(value, f.name), start, stop, size) for f in fields})
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_slice(item, start, stop, size) for item in value))
    if isinstance(value, (list, tuple)):
        if len(value) == size and all(_is_plain(item) for item in value):  # one value per sample
            return value[start:stop]
        return type(value)(_slice(item, start, stop, size) for item in value)
    return value


def _is_plain(value: Any) -> bool:
    """A value of one sample: a number, string, bool, None or 0-dim tensor."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0
    return value is None or isinstance(value, (int, float, str, bytes))


def _first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in ``value``, depth first; a plain recursion, not a generator (it runs every batch)."""
    if type(value) is tuple or type(value) is list:  # the common batch, ahead of the slower isinstance checks
        items: Iterable[Any] = value
    elif isinstance(value, torch.Tensor):
        return value
    elif isinstance(value, Mapping):
        items = value.values()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = (getattr(value, field.name) for field in dataclasses.fields(value))
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        return None
    for item in items:
        found = item if isinstance(item, torch.Tensor) else _first_tensor(item)
        if found is not None:
            return found
    return None
