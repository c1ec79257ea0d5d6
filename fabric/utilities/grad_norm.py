"""Clipping gradients by their total norm when the parameters are DTensors on different meshes.

``torch.nn.utils.clip_grad_norm_`` stacks every gradient's norm into one tensor, which DTensors on different meshes
(tensor-parallel layers beside FSDP-only ones) cannot join: each mesh's norm is taken on its own, as a plain tensor
the same on every rank, and the parts are combined.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    across: ProcessGroup | None = None,
) -> torch.Tensor:
    """Scale the gradients of ``parameters`` in place so that their total norm is at most ``max_norm``; returns the
    total norm (before clipping), a plain tensor. ``across``: a group whose ranks hold the other parameters (the
    stages of a pipeline); the norm is then the one over all of them."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for parameter in parameters:
        if parameter.grad is not None:
            groups.setdefault(getattr(parameter, "device_mesh", None), []).append(parameter)
    parts = []
    for grouped in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in grouped], norm_type)  # type: ignore[misc]
        parts.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(parts), norm_type) if parts else torch.tensor(0.0)
    if across is not None:
        total = _combined(total, norm_type, across)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} of the gradients is non-finite ({total.item()}).")
    for grouped in groups.values():
        torch.nn.utils.clip_grads_with_norm_(grouped, max_norm, total)
    return total


def _combined(norm: torch.Tensor, norm_type: float, group: ProcessGroup) -> torch.Tensor:
    """The norm of the parameters of every rank in ``group`` from each rank's own ``norm``."""
    import torch.distributed as dist

    if norm_type == float("inf"):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm.float() ** norm_type
    dist.all_reduce(powered, group=group)
    return powered ** (1.0 / norm_type)
