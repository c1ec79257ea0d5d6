"""Read and replace parts of a batch, whatever its shape, for algorithms that change inputs or targets.

Batches are ``(inputs, targets)`` sequences or mappings such as ``{"image": ..., "label": ...}``; an
algorithm names the part it changes with a key: an int index for sequences, a str key for mappings
(``input_key=0, target_key=1`` by default, like Composer). Setting returns a new batch of the same type,
so the caller's own tuple, list or dict is never changed behind its back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

BatchKey = int | str


def check_batch_key(name: str, key: object) -> BatchKey:
    """``key`` if it can address a batch part (an int index or a str key), else a ``TypeError`` naming ``name``."""
    if isinstance(key, bool) or not isinstance(key, int | str):
        raise TypeError(f"{name}={key!r} must be an int index (sequence batches) or a str key (mapping batches).")
    return key


def get_batch_item(batch: Any, key: BatchKey) -> Any:
    """The part of ``batch`` at ``key``: ``batch[key]`` for a mapping or a sequence."""
    if isinstance(batch, Mapping):
        if key not in batch:
            raise KeyError(f"The batch has no key {key!r}; its keys are {sorted(map(str, batch))}.")
        return batch[key]
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        if not isinstance(key, int) or not -len(batch) <= key < len(batch):
            raise IndexError(f"Key {key!r} does not index a batch of {len(batch)} parts; use an int in range.")
        return batch[key]
    raise TypeError(f"Cannot read {key!r} from a batch of type {type(batch).__name__}: expected a sequence or mapping.")


def set_batch_item(batch: Any, key: BatchKey, value: Any) -> Any:
    """A copy of ``batch`` (same type) whose part at ``key`` is ``value``; ``batch`` itself is unchanged."""
    get_batch_item(batch, key)  # same errors as reading
    if isinstance(batch, Mapping):
        return type(batch)({**batch, key: value})  # type: ignore[call-arg]
    parts = list(batch)
    parts[key] = value  # type: ignore[index]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*parts)
    return type(batch)(parts)


def index_batch(batch: Any, indices: torch.Tensor) -> Any:
    """The samples of ``batch`` at ``indices``: every tensor whose first dimension is the batch size is indexed,
    everything else (scalars, strings, per-batch values) is kept as is."""
    size = _first_dimension(batch)
    return _index(batch, indices, size)


def _first_dimension(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.shape[0])
    parts = value.values() if isinstance(value, Mapping) else value if isinstance(value, list | tuple) else ()
    for part in parts:
        if isinstance(part, torch.Tensor | Mapping | list | tuple):
            return _first_dimension(part)
    raise TypeError(f"Cannot tell the batch size of a {type(value).__name__}: it holds no tensor.")


def _index(value: Any, indices: torch.Tensor, size: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value[indices.to(value.device)] if value.ndim > 0 and value.shape[0] == size else value
    if isinstance(value, Mapping):
        return type(value)({key: _index(item, indices, size) for key, item in value.items()})  # type: ignore[call-arg]
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_index(item, indices, size) for item in value))
    if isinstance(value, list | tuple):
        return type(value)(_index(item, indices, size) for item in value)
    return value
