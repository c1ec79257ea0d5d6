"""Resume mid-epoch by samples: with another number of ranks or another batch size, every sample of the epoch
that was not trained yet is trained once, and none twice.

The exact resume (:mod:`~fabric.trainer.checkpoint.dataloader_position`) rebuilds the interrupted epoch's batches
and skips the finished ones: it needs the world size and the batch size of the checkpoint. When either changed,
the Trainer resumes here instead, for epochs whose order does not depend on the number of ranks: a
``DistributedSampler`` (what Fabric shards a shuffling or sequential loader with) draws one permutation from its
seed and epoch and gives rank ``r`` every ``num_replicas``-th sample of it, and a single process's
``SequentialSampler`` goes in index order. A checkpoint records which samples of the epoch the ranks trained (a
bit per sample); the resumed epoch deals the remaining ones, in the epoch's order, to the new ranks in batches of
the new size, every rank the same number of batches (a collective waits for all). Random numbers are not the
same as in the uninterrupted run, so a resume this way is exact in samples, not bit for bit.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, SequentialSampler

from fabric.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from fabric.trainer.checkpoint.trainer_state import DataPosition


@dataclass(frozen=True)
class EpochOrder:
    """How an epoch's samples are ordered, independent of the number of ranks."""

    num_samples: int
    shuffle: bool
    seed: int
    epoch: int

    def permutation(self) -> torch.Tensor:
        """The sample indices in epoch order (a ``DistributedSampler``'s draw for this seed and epoch)."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        return torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def state_dict(self) -> dict[str, Any]:
        return {"num_samples": self.num_samples, "shuffle": self.shuffle, "seed": self.seed, "epoch": self.epoch}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> EpochOrder:
        return cls(int(state["num_samples"]), bool(state["shuffle"]), int(state["seed"]), int(state["epoch"]))


def epoch_order(dataloader: object) -> EpochOrder | None:
    """The order of ``dataloader``'s current epoch if it does not depend on the number of ranks, else None."""
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        return None
    sampler: Any = dataloader.batch_sampler if dataloader.batch_sampler is not None else dataloader.sampler
    if type(sampler) is BatchSampler:
        sampler = sampler.sampler
    if type(sampler) is DistributedSampler:
        if sampler.drop_last:
            return None  # the dropped tail depends on the number of ranks
        return EpochOrder(len(sampler.dataset), sampler.shuffle, sampler.seed, sampler.epoch)  # type: ignore[arg-type]
    if type(sampler) is SequentialSampler:
        return EpochOrder(len(sampler), False, 0, 0)
    return None


def trained_in_layout(order: EpochOrder, data_shares: int, batch_size: int, batches_done: int) -> torch.Tensor:
    """The samples trained after ``batches_done`` batches of ``batch_size`` on each of ``data_shares`` shares in the
    epoch's own layout: a ``DistributedSampler`` deals the order round-robin (padded by repeating its start), so
    those are its first ``batches_done * batch_size * data_shares`` positions."""
    trained = torch.zeros(order.num_samples, dtype=torch.bool)
    if order.shuffle:
        permutation = torch.randperm(
            order.num_samples, generator=torch.Generator().manual_seed(order.seed + order.epoch)
        )
    else:
        permutation = torch.arange(order.num_samples)
    trained[permutation[: batches_done * batch_size * data_shares]] = True
    return trained


def layout_batch_size(dataloader: object) -> int | None:
    """Samples per batch on each rank, or None when the loader does not batch with a fixed size."""
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    if type(batch_sampler) is BatchSampler:
        return int(batch_sampler.batch_size)
    return None


class EpochPlan:
    """Which samples of an epoch each rank trains, batch by batch: the epoch's order, minus what was trained
    before (``trained``, a bool per sample), dealt to ``data_shares`` ranks in batches of ``batch_size``."""

    def __init__(self, order: EpochOrder, trained: torch.Tensor, data_shares: int, batch_size: int) -> None:
        self.order = order
        self.trained = trained
        self.data_shares = data_shares
        self.batch_size = batch_size
        permutation = order.permutation()
        remaining = permutation[~trained[permutation]].tolist()
        self.batches = _deal(remaining, data_shares, batch_size)

    def trained_after(self, batches_done: int) -> torch.Tensor:
        """The samples trained once every rank did ``batches_done`` batches of this plan."""
        trained = self.trained.clone()
        for rank_batches in self.batches:
            for batch in rank_batches[:batches_done]:
                trained[batch] = True
        return trained

    def batches_of(self, rank: int) -> list[list[int]]:
        return self.batches[rank]


def _deal(remaining: Sequence[int], data_shares: int, batch_size: int) -> list[list[list[int]]]:
    """Every share every ``data_shares``-th remaining sample, in batches of ``batch_size``, each share the same
    number of batches: the last batches are evened out, and only when fewer samples than shares remain does a share
    repeat one (with a warning)."""
    shares = [list(remaining[rank::data_shares]) for rank in range(data_shares)]
    count = max(math.ceil(len(share) / batch_size) for share in shares) if remaining else 0
    if count and any(len(share) < count for share in shares):
        repeated = [share for share in shares if len(share) < count]
        rank_zero_warn(
            f"Only {len(remaining)} samples of the epoch remain for {data_shares} data shares: {len(repeated)} "
            "share(s) repeat a sample so that every rank trains the same number of batches."
        )
        for share in repeated:
            share.extend(remaining[: count - len(share)])
    return [_split(share, count, batch_size) for share in shares]


def _split(share: list[int], count: int, batch_size: int) -> list[list[int]]:
    """``share`` in ``count`` batches of at most ``batch_size``, as full as they can be while every later batch
    still gets a sample."""
    batches, start = [], 0
    for position in range(count):
        size = min(batch_size, len(share) - start - (count - position - 1))
        batches.append(share[start : start + size])
        start += size
    return batches


def pack(trained: torch.Tensor) -> torch.Tensor:
    """A bool per sample as bits in uint8 (what a checkpoint stores: an eighth of the bytes)."""
    padded = torch.zeros(math.ceil(trained.numel() / 8) * 8, dtype=torch.uint8)
    padded[: trained.numel()] = trained.to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack(bits: torch.Tensor, num_samples: int) -> torch.Tensor:
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    return ((bits.view(-1, 1) & weights) != 0).view(-1)[:num_samples]


class PlannedBatches:
    """A batch sampler that yields one rank's batches of an :class:`EpochPlan` (the resumed epoch)."""

    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


# --- what the Trainer saves and resumes with -----------------------------------------------------------------


def samples_record(
    dataloader: object, data_shares: int, batches_done: int, epoch_plan: tuple[EpochPlan, int] | None
) -> dict[str, Any] | None:
    """What a checkpoint taken ``batches_done`` batches into the epoch records for a resume by samples: the
    dataset's length and the batch size (to refuse a resume that cannot keep the position), and, for an order
    that does not depend on the ranks, the epoch's order and which samples were trained."""
    dataset = getattr(dataloader, "dataset", None)
    if dataset is None or isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        return None
    record: dict[str, Any] = {"dataset_length": len(dataset), "batch_size": layout_batch_size(dataloader)}
    if epoch_plan is not None:
        plan, counted_before = epoch_plan
        order, trained = plan.order, plan.trained_after(batches_done - counted_before)
    else:
        order = epoch_order(dataloader)  # type: ignore[assignment]
        batch_size = record["batch_size"]
        if order is None or batch_size is None:
            return record
        trained = trained_in_layout(order, data_shares, batch_size, batches_done)
    record.update(order=order.state_dict(), trained=pack(trained))
    return record


def layout_change(position: DataPosition, dataloader: object, data_shares: int) -> str | None:
    """How this run's layout differs from the checkpoint's ("2 data share(s) -> 1, batch size 8 -> 16"), or None."""
    changes = []
    if position.data_shares != data_shares:
        changes.append(f"{position.data_shares} data share(s) -> {data_shares}")
    saved_batch_size = (position.samples or {}).get("batch_size")
    batch_size = layout_batch_size(dataloader)
    if saved_batch_size is not None and batch_size is not None and saved_batch_size != batch_size:
        changes.append(f"batch size {saved_batch_size} -> {batch_size}")
    return ", ".join(changes) or None


def check_resumable(position: DataPosition, dataloader: object, data_shares: int) -> None:
    """Refuse, before anything is loaded, a mid-epoch position this run cannot continue without losing or
    repeating samples: another dataset length, or another layout where the epoch's order is unknown."""
    samples = position.samples or {}
    dataset = getattr(dataloader, "dataset", None)
    way_out = "Pass load_ignore_keys=['dataloader'] to start this epoch over, or resume with the checkpoint's settings."
    length = samples.get("dataset_length")
    if length is not None and hasattr(dataset, "__len__") and len(dataset) != length:  # type: ignore[arg-type]
        raise ValueError(
            f"The checkpoint was taken {position.batches_done} batches into an epoch of a dataset of {length} "
            f"samples; this run's dataset has {len(dataset)}: which samples are left cannot be told. {way_out}"  # type: ignore[arg-type]
        )
    change = layout_change(position, dataloader, data_shares)
    if change is not None and (samples.get("order") is None or layout_batch_size(dataloader) is None):
        raise ValueError(
            f"The checkpoint was taken {position.batches_done} batches into an epoch, and this run has {change}; "
            "the epoch's order depends on the number of ranks or is unknown (resuming by samples needs a "
            "map-style dataset with a DistributedSampler, which Fabric shards with, or a single process's "
            f"SequentialSampler, in a plain BatchSampler), so samples would be lost or repeated. {way_out}"
        )


def count_untrained(samples: dict[str, Any]) -> int:
    length = int(samples["order"]["num_samples"])
    return length - int(unpack(samples["trained"], length).sum())


def resumed_plan(samples: dict[str, Any], dataloader: object, data_shares: int) -> EpochPlan:
    """The plan of the rest of the epoch on this run's ranks, in this run's batch size."""
    order = EpochOrder.from_state_dict(samples["order"])
    batch_size = layout_batch_size(dataloader)
    assert batch_size is not None  # check_resumable refused it otherwise
    return EpochPlan(order, unpack(samples["trained"], order.num_samples), data_shares, batch_size)


def planned_epoch(dataloader: Iterable[Any], batches: list[list[int]], epoch_start: dict[str, Any]) -> Iterator[Any]:
    """The loader's batches for ``batches`` (its own fetching, collation and device), then the loader set to
    go on with the next epoch as the interrupted run would have."""
    from fabric.wrappers import FabricDataLoader

    planned = copy.copy(dataloader)
    object.__setattr__(planned, "batch_sampler", PlannedBatches(batches))
    object.__setattr__(planned, "_iterator", None)
    yield from planned
    if isinstance(dataloader, FabricDataLoader) and epoch_start.get("fabric_epoch") is not None:
        dataloader._fabric_epoch = int(epoch_start["fabric_epoch"]) + 1
