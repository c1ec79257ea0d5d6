"""Shard a user's ``DataLoader`` across ranks without re-running (or patching) its constructor.

The loader is shallow-copied, so it keeps its class and every setting, and only its sampler and batch
sampler are replaced by sharding versions:

- the default samplers (``RandomSampler``/``SequentialSampler``) become a ``DistributedSampler`` that
  keeps the shuffle flag and uses the seed of ``seed_everything``;
- any other sampler, and any custom batch sampler, is wrapped so each rank takes every
  ``world_size``-th element, padded so that all ranks see the same number of batches (a rank with
  fewer batches would leave the others waiting in a collective).
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler
from torch.utils.data import SequentialSampler as _SequentialSampler

from fabric.utilities.rank_zero import rank_zero_warn
from fabric.utilities.seed import SEED_ENV_VAR

T = TypeVar("T")


class ShardedSampler(Sampler[T]):
    """Every ``num_replicas``-th element of another sampler (or batch sampler), starting at ``rank``."""

    def __init__(self, sampler: Iterable[T], num_replicas: int, rank: int) -> None:
        self.sampler = sampler
        self.num_replicas = num_replicas
        self.rank = rank

    def __iter__(self) -> Iterator[T]:
        items = list(self.sampler)
        if not items:
            return iter([])
        padded_length = math.ceil(len(items) / self.num_replicas) * self.num_replicas
        items += (items * math.ceil(padded_length / len(items)))[: padded_length - len(items)]
        return iter(items[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.num_replicas)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the wrapped sampler, so a custom shuffling sampler reshuffles."""
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)  # type: ignore[attr-defined]


def shard_dataloader(dataloader: DataLoader[Any], num_replicas: int, rank: int) -> DataLoader[Any]:
    """A copy of ``dataloader`` that yields only this rank's share of the data."""
    if isinstance(dataloader.dataset, IterableDataset):
        if not shards_itself(dataloader.dataset):
            rank_zero_warn(
                f"The dataloader wraps an IterableDataset ({type(dataloader.dataset).__name__}), which Fabric cannot "
                "shard: unless the dataset yields a different part of the data on each rank (by the RANK and "
                "WORLD_SIZE variables, which every rank has), every rank trains on the same samples. A dataset "
                "that does shard itself can say so with a class attribute `shards_by_rank = True`."
            )
        return dataloader
    batch_sampler = dataloader.batch_sampler
    sampler: Any = dataloader.sampler
    if any(isinstance(s, DistributedSampler) for s in (sampler, getattr(batch_sampler, "sampler", None))):
        return dataloader  # already sharded by the user
    if batch_sampler is None:  # batch_size=None: the sampler yields single samples that are not collated
        sampler = _shard_sampler(dataloader, sampler, num_replicas, rank)
    elif type(batch_sampler) is BatchSampler:
        sampler = _shard_sampler(dataloader, batch_sampler.sampler, num_replicas, rank)
        batch_sampler = BatchSampler(sampler, batch_sampler.batch_size, batch_sampler.drop_last)
    else:
        batch_sampler = ShardedSampler(batch_sampler, num_replicas, rank)
    sharded = copy.copy(dataloader)
    # DataLoader forbids re-assigning these after __init__; on our own copy, replacing both together
    # keeps it consistent.
    object.__setattr__(sharded, "sampler", sampler)
    object.__setattr__(sharded, "batch_sampler", batch_sampler)
    object.__setattr__(sharded, "_iterator", None)
    return sharded


def shards_itself(dataset: IterableDataset[Any]) -> bool:
    """Whether an iterable dataset splits the data between ranks itself: it says so (``shards_by_rank = True``),
    or it is one known to: mosaicml-streaming's ``StreamingDataset``, a Hugging Face ``IterableDataset`` from
    ``split_dataset_by_node``."""
    if getattr(dataset, "shards_by_rank", False) is True:
        return True
    known = any(
        cls.__name__ == "StreamingDataset" and cls.__module__.partition(".")[0] == "streaming"
        for cls in type(dataset).__mro__
    )
    split_by_node = type(dataset).__module__.partition(".")[0] == "datasets" and bool(
        getattr(dataset, "_distributed", None)
    )
    return known or split_by_node


def _shard_sampler(dataloader: DataLoader[Any], sampler: Iterable[Any], num_replicas: int, rank: int) -> Sampler[Any]:
    if isinstance(sampler, (RandomSampler, _SequentialSampler)):
        return DistributedSampler(
            dataloader.dataset,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=isinstance(sampler, RandomSampler),
            seed=int(os.environ.get(SEED_ENV_VAR, 0)),
        )
    return ShardedSampler(sampler, num_replicas, rank)
