"""Context parallelism: the sequence of each batch split over the mesh's ``context_parallel`` ranks, on torch's
``torch.distributed.tensor.experimental.context_parallel`` (ring attention inside ``scaled_dot_product_attention``).

The ranks of one context-parallel group read the same batches (data is split over the data-parallel dimensions
only); inside :func:`sequence_sharded` each of them holds its part of the sequence of the buffers given (inputs,
targets, positional buffers), computed on in place by torch, and attention exchanges keys and values around the
group. FSDP shards over ``data_parallel x context_parallel`` together, so the gradients of the parts are averaged
over the group as over data-parallel ranks: with a per-token mean loss and parts of equal length, the gradients are
those of the whole sequence.

torch shards its CUDA attention kernels only (flash, memory-efficient, cuDNN): on CPU,
``aten._scaled_dot_product_flash_attention_for_cpu`` has no sharding strategy, forward or backward (measured on torch
2.13), so a mesh with ``context_parallel`` above 1 is refused on other devices (:func:`refusal`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: The device types whose attention kernels torch's ``context_parallel`` shards.
DEVICE_TYPES = ("cuda",)


def refusal(degree: int, device_type: str, pipelined: bool) -> str | None:
    """Why a mesh with ``context_parallel=degree`` cannot run on ``device_type`` (with pipeline stages when
    ``pipelined``), in one line; None where it can."""
    if degree == 1:
        return None
    if device_type not in DEVICE_TYPES:
        return (
            f"MeshPlan(context_parallel={degree}) needs CUDA (got {device_type!r}): torch's context_parallel shards "
            "the CUDA attention kernels only (on CPU aten._scaled_dot_product_flash_attention_for_cpu has no sharding "
            "strategy, forward or backward)."
        )
    if pipelined:
        return f"MeshPlan(context_parallel={degree}) with pipeline stages is not wired yet; use one or the other."
    return None


def torch_context_parallel() -> Callable[..., AbstractContextManager[None]]:
    """torch's ``context_parallel`` (the one boundary the CPU tests replace, with an exact sequence split)."""
    from torch.distributed.tensor.experimental import context_parallel

    return context_parallel


@contextmanager
def sequence_sharded(
    mesh: DeviceMesh, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int], no_restore: Sequence[torch.Tensor]
) -> Iterator[None]:
    """Inside: each buffer holds this rank's part of its dimension ``seq_dims[i]`` (restored on exit, except those in
    ``no_restore``), and attention runs on the kernels torch can shard."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if len(buffers) != len(seq_dims):
        raise ValueError(
            f"fabric.context_parallel got {len(buffers)} buffers and {len(seq_dims)} seq_dims: give each buffer the "
            "dimension of its sequence (e.g. 1 for (batch, sequence) tokens)."
        )
    kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    shard: Any = torch_context_parallel()
    sharded = shard(mesh, buffers=list(buffers), buffer_seq_dims=list(seq_dims), no_restore_buffers=set(no_restore))
    with sharded, sdpa_kernel(kernels):
        yield
