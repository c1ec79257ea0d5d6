"""Gathering per-sample results without the samples a sharded loader repeated to even out the ranks.

``DistributedSampler`` (and Fabric's ``ShardedSampler``) pad the index list to a multiple of the number
of ranks by repeating its start, then deal it out: the ``j``-th sample of rank ``q`` is position
``j * num_replicas + q`` of the padded list, and positions past the real number of samples are the
repeats. Knowing how many rows this rank gathered before in the current pass over the loader is enough
to put every gathered row back at its position and cut the repeats off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader, DistributedSampler

from fabric.utilities.data import ShardedSampler


class SampleSharding(NamedTuple):
    """How a loader's samples are dealt out: ``rank`` of ``num_replicas``, ``share`` samples per rank and pass,
    and ``real`` samples before padding (``None``: nothing is padded)."""

    num_replicas: int
    rank: int
    share: int
    real: int | None


def gather_unpadded(data: Any, dataloader: DataLoader[Any], all_gather: Callable[[torch.Tensor], Any]) -> Any:
    """Every rank's rows of ``data`` (tensors whose first dimension is one row per sample of ``dataloader``),
    concatenated in sample order without the repeats; ``all_gather`` gives ``(world_size, ...)``."""
    row_counts: set[int] = set()
    apply_to_collection(data, torch.Tensor, lambda tensor: row_counts.add(tensor.shape[0] if tensor.ndim else -1))
    if len(row_counts) != 1 or -1 in row_counts:
        raise ValueError(
            "gather_for_metrics() takes tensors whose first dimension holds one row per sample, the same for "
            f"every tensor; got first dimensions {sorted(row_counts)} (-1: a scalar)."
        )
    rows = row_counts.pop()
    sharding = sample_sharding(dataloader)
    if sharding is None:
        return apply_to_collection(data, torch.Tensor, lambda tensor: _stacked(all_gather(tensor)).flatten(0, 1))
    before = rows_before(dataloader, rows)
    if before + rows > sharding.share:
        raise ValueError(
            f"gather_for_metrics(): this rank gave {before + rows} rows in this pass over the dataloader, more than "
            f"its {sharding.share} samples; give each sample's row once, in the loader's order."
        )
    sampler_ranks = _stacked(all_gather(torch.tensor(sharding.rank))).tolist()
    return apply_to_collection(
        data, torch.Tensor, lambda tensor: unpadded_rows(_stacked(all_gather(tensor)), sampler_ranks, sharding, before)
    )


def _stacked(gathered: Any) -> torch.Tensor:
    if isinstance(gathered, list):  # all_gather's answer to first dimensions that differ across ranks
        raise ValueError(
            "gather_for_metrics() needs as many rows from every rank (a sharded loader gives each rank as many "
            f"samples); got {[len(part) for part in gathered]}."
        )
    return gathered  # type: ignore[no-any-return]


def sample_sharding(dataloader: DataLoader[Any]) -> SampleSharding | None:
    """The per-sample sharding of ``dataloader``, or ``None`` when its samples are not sharded."""
    batch_sampler = dataloader.batch_sampler
    if isinstance(batch_sampler, ShardedSampler):
        raise ValueError(
            "gather_for_metrics() puts rows back by sample position, but this dataloader's custom batch sampler "
            "is sharded by whole batches; gather with fabric.all_gather and drop repeated batches yourself."
        )
    sampler = dataloader.sampler if batch_sampler is None else getattr(batch_sampler, "sampler", None)
    if isinstance(sampler, DistributedSampler):
        real = None if sampler.drop_last else len(sampler.dataset)  # type: ignore[arg-type]
        return SampleSharding(sampler.num_replicas, sampler.rank, sampler.num_samples, real)
    if isinstance(sampler, ShardedSampler):
        real = len(sampler.sampler)  # type: ignore[arg-type]
        return SampleSharding(sampler.num_replicas, sampler.rank, len(sampler), real)
    return None


def rows_before(dataloader: DataLoader[Any], rows: int) -> int:
    """How many rows this rank gathered earlier in the loader's current pass; counts ``rows`` for the next call.

    A pass is one ``iter(dataloader)`` of a loader set up by Fabric (which numbers its passes).
    """
    current_pass = getattr(dataloader, "_fabric_epoch", None)
    if current_pass is None:
        raise ValueError(
            "gather_for_metrics() needs a dataloader returned by fabric.setup_dataloaders(), which counts its "
            f"passes; got a plain {type(dataloader).__name__}."
        )
    last_pass, before = dataloader.__dict__.get("_fabric_gathered_rows", (current_pass, 0))
    if last_pass != current_pass:
        before = 0
    dataloader.__dict__["_fabric_gathered_rows"] = (current_pass, before + rows)
    return int(before)


def unpadded_rows(
    per_rank: torch.Tensor, sampler_ranks: list[int], sharding: SampleSharding, before: int
) -> torch.Tensor:
    """Rows of all ranks in sample order, without repeats.

    ``per_rank`` is ``(world_size, rows, ...)``: each process's rows ``before .. before + rows`` of its share;
    ``sampler_ranks[p]`` is the sampler rank of process ``p`` (processes sharing a rank hold the same rows).
    """
    rows = per_rank.shape[1]
    first_of_rank = {rank: process for process, rank in reversed(list(enumerate(sampler_ranks)))}
    if sorted(first_of_rank) != list(range(sharding.num_replicas)):
        raise RuntimeError(
            f"gather_for_metrics(): the processes hold sampler ranks {sampler_ranks}, not every rank of "
            f"{sharding.num_replicas}; they must iterate the same dataloader."
        )
    ordered = per_rank[[first_of_rank[rank] for rank in range(sharding.num_replicas)]]
    interleaved = ordered.transpose(0, 1).reshape(rows * sharding.num_replicas, *per_rank.shape[2:])
    if sharding.real is None:
        return interleaved
    return interleaved[: max(0, sharding.real - before * sharding.num_replicas)]
