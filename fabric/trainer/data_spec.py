"""``DataSpec``: a dataloader with the functions that say how to move, transform, split and count its batches.

Pass one to the Trainer wherever a dataloader goes (``train_dataloader``, ``eval_dataloader``, an
:class:`~fabric.trainer.evaluation.Evaluator`'s ``dataloader``, ``predict``) when batches are of a type
the defaults do not understand, or need work on the way in::

    spec = DataSpec(
        loader,
        batch_transforms=normalize_on_cpu,           # each batch, before it moves to the device
        device_transforms=augment_on_device,         # each batch, after it moved
        split_batch=lambda batch, size: batch.chunks(size),
        get_num_samples_in_batch=lambda batch: batch.num_rows,
        get_num_tokens_in_batch=lambda batch: int(batch.mask.sum()),
    )
    Trainer(model=model, train_dataloader=spec, ...)

The defaults understand tensors and (nested) tuples, lists, dicts, namedtuples and dataclasses of
tensors: samples are the first dimension of the first tensor and splitting slices every tensor along
it. Tokens count, in order of precedence: the spec's ``get_num_tokens_in_batch``, the Trainer's
``get_num_tokens_in_batch``, the model's ``get_num_tokens_in_batch`` method, else the elements of
``batch["input_ids"]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from fabric.trainer.microbatch import batch_size, split_batch


class DataSpec:
    """A dataloader (any iterable of batches) with how to transform, split and count its batches (Composer's)."""

    def __init__(
        self,
        dataloader: Iterable[Any],
        num_samples: int | None = None,
        num_tokens: int | None = None,
        *,
        batch_transforms: Callable[[Any], Any] | None = None,
        device_transforms: Callable[[Any], Any] | None = None,
        split_batch: Callable[[Any, int], Sequence[Any]] | None = None,
        get_num_samples_in_batch: Callable[[Any], int] | None = None,
        get_num_tokens_in_batch: Callable[[Any], int] | None = None,
    ) -> None:
        if isinstance(dataloader, DataSpec):
            raise TypeError("DataSpec(dataloader) got a DataSpec; pass its .dataloader, or use it as it is.")
        if not isinstance(dataloader, Iterable):
            raise TypeError(
                f"DataSpec needs an iterable of batches (e.g. a DataLoader), got {type(dataloader).__name__}."
            )
        functions = {
            "batch_transforms": batch_transforms,
            "device_transforms": device_transforms,
            "split_batch": split_batch,
            "get_num_samples_in_batch": get_num_samples_in_batch,
            "get_num_tokens_in_batch": get_num_tokens_in_batch,
        }
        for name, function in functions.items():
            if function is not None and not callable(function):
                raise TypeError(f"DataSpec({name}=...) must be callable or None, got {type(function).__name__}.")
        for name, count in (("num_samples", num_samples), ("num_tokens", num_tokens)):
            if count is not None and (type(count) is not int or count < 0):
                raise ValueError(f"DataSpec({name}={count!r}) must be a non-negative int or None.")
        self.dataloader = dataloader
        #: Samples in an epoch over every rank (Composer's; llm-foundry's eval gauntlet reads it): given, else the
        #: length of a DataLoader's sized dataset, else None.
        self.num_samples = _dataset_length(dataloader) if num_samples is None else num_samples
        #: Tokens in an epoch, when given (Composer's; not computed).
        self.num_tokens = num_tokens
        self.batch_transforms = batch_transforms
        self.device_transforms = device_transforms
        self._split_batch = split_batch
        self._num_samples = get_num_samples_in_batch
        #: None: the Trainer decides (its own ``get_num_tokens_in_batch``, the model's, or ``input_ids``).
        self.num_tokens_function = get_num_tokens_in_batch

    def split_batch(self, batch: Any, microbatch_size: int) -> Sequence[Any]:
        """``batch`` as microbatches of at most ``microbatch_size`` samples; checked to be a non-empty sequence."""
        if self._split_batch is None:
            return split_batch(batch, microbatch_size)
        microbatches = self._split_batch(batch, microbatch_size)
        if not isinstance(microbatches, Sequence) or isinstance(microbatches, (str, bytes)) or not microbatches:
            raise TypeError(
                f"DataSpec split_batch returned {type(microbatches).__name__} "
                f"{microbatches if not isinstance(microbatches, Sequence) else '(empty)'}; "
                "it must return a non-empty list of microbatches."
            )
        return microbatches

    def samples_counter(self) -> Callable[[Any], int]:
        """What :meth:`get_num_samples_in_batch` calls, resolved once: the first tensor's first dimension without a
        function of the user's (which is checked)."""
        return batch_size if self._num_samples is None else self.get_num_samples_in_batch

    def get_num_samples_in_batch(self, batch: Any) -> int:
        """Samples in ``batch`` on this rank (the user's function, else the first tensor's first dimension)."""
        if self._num_samples is None:
            return batch_size(batch)
        count = self._num_samples(batch)
        return count if type(count) is int and count >= 0 else _count(count, "get_num_samples_in_batch")

    def get_num_tokens_in_batch(self, batch: Any, default: Callable[[Any], Any], token_type: str = "total") -> int:
        """Tokens in ``batch`` on this rank: the spec's function when given, else ``default``. A function may count
        kinds of tokens in a dict (Composer's ``{"total": ..., "loss_generating": ...}``): ``token_type`` picks one;
        a plain count answers every kind."""
        count = (self.num_tokens_function or default)(batch)
        if type(count) is int and count >= 0:
            return count
        if isinstance(count, Mapping):
            if token_type not in count:
                raise ValueError(
                    f"DataSpec get_num_tokens_in_batch returned counts of {sorted(count)}; {token_type!r} is needed."
                )
            count = count[token_type]
        return _count(count, "get_num_tokens_in_batch")

    def prepare(self, batch: Any, to_device: Callable[[Any], Any]) -> Any:
        """``batch`` as the model gets it: ``batch_transforms``, then ``to_device``, then ``device_transforms``.

        The Trainer sets up a spec's DataLoader so that it yields batches where they are (not moved)
        when there are ``batch_transforms``; otherwise Fabric's loader moved them already and
        ``to_device`` leaves them alone.
        """
        if self.batch_transforms is not None:
            batch = to_device(self.batch_transforms(batch))
        if self.device_transforms is not None:
            batch = self.device_transforms(batch)
        return batch

    @property
    def transforms(self) -> bool:
        """Whether batches need :meth:`prepare` at all (so plain loaders pay nothing per batch)."""
        return self.batch_transforms is not None or self.device_transforms is not None


def ensure_data_spec(dataloader: Iterable[Any] | DataSpec) -> DataSpec:
    """``dataloader`` itself when it is a DataSpec, else a DataSpec with the default functions around it."""
    return dataloader if isinstance(dataloader, DataSpec) else DataSpec(dataloader)


def _count(value: Any, name: str) -> int:
    """A user function's count as an int (a one-element tensor's item), or an error naming the function."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"DataSpec {name} returned {value!r}; it must return a whole number, at least 0.")
    return value


def _dataset_length(dataloader: Iterable[Any]) -> int | None:
    """``len(dataloader.dataset)`` for a DataLoader whose dataset has a length, else None."""
    if not isinstance(dataloader, DataLoader):
        return None
    try:
        return len(dataloader.dataset)  # type: ignore[arg-type]
    except TypeError:  # an iterable-style dataset without __len__
        return None
