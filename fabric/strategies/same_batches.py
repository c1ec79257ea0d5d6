"""The ranks that hold parts of one model copy (a tensor-parallel group, the stages of a pipeline) must be given the
same batches; a check at the first forward makes a loader that splits the data over every rank fail loudly.

A dataloader that shards itself by ``RANK``/``WORLD_SIZE`` (mosaicml-streaming's ``StreamingDataset``, llm-foundry's
loaders) gives each rank of a tensor-parallel group different samples. Nothing in torch notices: each rank computes its
columns of a layer on other inputs, the parameters outside the plan are averaged over the data-parallel ranks only,
and training silently leaves what one process would do. :func:`refuse_different_batches` compares a fingerprint of
the first batch across the ranks that share a data-parallel index (one ``all_gather_object``, once per module).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

Fingerprint = list[tuple[tuple[int, ...], str, float, float]]


def batch_fingerprint(batch: Any) -> Fingerprint:
    """Shape, dtype, sum and a position-weighted sum of every tensor in ``batch`` (equal batches give equal prints;
    a different sample, or the same samples in another order, changes them)."""
    prints: Fingerprint = []
    for tensor in _tensors(batch):
        values = tensor.detach().to(torch.float64).flatten()
        weights = torch.arange(values.numel(), dtype=torch.float64, device=values.device) % 7 + 1
        prints.append((tuple(tensor.shape), str(tensor.dtype), values.sum().item(), (values * weights).sum().item()))
    return prints


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value``, also inside mappings torch's pytree does not know (Hugging Face's
    ``BatchEncoding``, llm-foundry's batches) and dataclasses."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _tensors(getattr(value, field.name))
    else:
        yield from (leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor) and leaf is not value)


def refuse_different_batches(batch: Any, data_parallel_index: Hashable, sharers: str) -> None:
    """Raise a ``ValueError`` on every rank when ranks with the same ``data_parallel_index`` were given different
    ``batch``es (a collective: every rank calls it at the same forward). ``sharers`` names their dimensions; under
    context parallelism the forward sees a part of the sequence, so there the index is the pair of the data-parallel
    and the context-parallel positions (the whole batches are compared when the sequence is split)."""
    mine = (data_parallel_index, batch_fingerprint(batch))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for index in sorted({entry[0] for entry in everyone}):
        ranks = [rank for rank, entry in enumerate(everyone) if entry[0] == index]
        differing = [rank for rank in ranks if everyone[rank][1] != everyone[ranks[0]][1]]
        if differing:
            raise ValueError(
                f"Ranks {ranks[0]} and {differing[0]} hold parts of one model copy ({sharers}) and must be given the "
                "same batches, but their first batches differ. A dataloader that splits the data itself by RANK and "
                "WORLD_SIZE (e.g. mosaicml-streaming's StreamingDataset) splits it over every rank: split it over the "
                "data-parallel ranks only (fabric.strategy.data_parallel_shard gives the number of shares and this "
                "rank's; a StreamingDataset takes replication=<ranks of one model copy>, llm-foundry's "
                "train_loader.dataset.replication), or let fabric.setup_dataloaders split it."
            )


def check_first_batch(module: nn.Module, check: Callable[[Any], None]) -> None:
    """Run ``check((args, kwargs))`` before ``module``'s first forward, then never again."""

    def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        handle.remove()
        check((args, kwargs))

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
