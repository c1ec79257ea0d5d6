"""A stand-in for mosaicml-streaming's ``StreamingDataset`` and ``StreamingDataLoader``, with their resumption API.

The dataset yields ``{"id": i, "x": ...}`` for ids ``0..num_samples-1`` in an order fixed by the seed and the
epoch, whatever the number of ranks ("elastic determinism"). Each rank takes every ``WORLD_SIZE``-th of the samples
left in the epoch, starting at ``RANK`` (read from the environment, as streaming does). Like streaming:

- ``dataset.state_dict(num_samples, from_beginning)`` (two required arguments: calling it without them fails, as
  streaming's does) says where in the epoch ``num_samples`` samples of all ranks leave it;
  ``dataset.load_state_dict(state)`` makes the next epoch start there, on any number of ranks;
- ``loader.state_dict()`` / ``loader.load_state_dict(state)``: the loader counts the samples it yielded;
- ``shards_by_rank = True`` declares that the dataset splits the data between ranks itself.

Use ``num_workers=0``: the epoch bookkeeping lives in the dataset object of the main process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset


class StreamingLikeDataset(IterableDataset[dict[str, Any]]):
    shards_by_rank = True

    def __init__(self, num_samples: int, seed: int = 0) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self.next_epoch = 0
        self._resume: tuple[int, int] | None = None
        self._epoch = 0
        self._offset = 0

    def __len__(self) -> int:
        """Samples per rank in a whole epoch (what a loader's length is counted from)."""
        return self.num_samples // _world()[1]

    def order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        rank, world = _world()
        epoch, offset = self._resume if self._resume is not None else (self.next_epoch, 0)
        self._resume = None
        if offset >= self.num_samples:  # saved at the end of an epoch: the next one starts
            epoch, offset = epoch + 1, 0
        self._epoch, self._offset, self.next_epoch = epoch, offset, epoch + 1
        for sample_id in self.order(epoch)[offset:][rank::world]:
            yield {"id": sample_id, "x": torch.full((4,), float(sample_id)), "y": torch.tensor([float(sample_id % 3)])}

    def state_dict(self, num_samples: int, from_beginning: bool) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "sample_in_epoch": num_samples if from_beginning else self._offset + num_samples,
            "shuffle_seed": self.seed,
        }

    def load_state_dict(self, obj: dict[str, Any]) -> None:
        self._resume = (int(obj["epoch"]), int(obj["sample_in_epoch"]))


class StreamingLikeLoader(DataLoader[Any]):
    """Counts the samples it yielded in the current epoch; its state is the dataset's at that point."""

    def __init__(self, dataset: StreamingLikeDataset, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.num_samples_yielded = 0

    def __iter__(self) -> Iterator[Any]:
        self.num_samples_yielded = 0
        for batch in super().__iter__():
            self.num_samples_yielded += len(batch["id"])
            yield batch

    def state_dict(self) -> dict[str, Any]:
        dataset = self.dataset
        assert isinstance(dataset, StreamingLikeDataset)
        return dataset.state_dict(self.num_samples_yielded * _world()[1], False)

    def load_state_dict(self, obj: dict[str, Any]) -> None:
        dataset = self.dataset
        assert isinstance(dataset, StreamingLikeDataset)
        dataset.load_state_dict(obj)


def _world() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
