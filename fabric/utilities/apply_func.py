"""Collection helpers: move or cast every tensor inside nested tuples, lists, dicts and dataclasses."""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection


def move_data_to_device(data: Any, device: torch.device) -> Any:
    """Move every tensor (and anything with a tensor-like ``.to``) inside ``data`` to ``device``."""
    if isinstance(data, torch.Tensor):  # fast path: the common single-tensor case skips the traversal
        return data.to(device, non_blocking=device.type == "cuda")
    return apply_to_collection(data, torch.Tensor, _to_device, device)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.to(device, non_blocking=device.type == "cuda")


def convert_floating_tensors(data: Any, dst: torch.dtype, src: tuple[torch.dtype, ...] | None = None) -> Any:
    """Cast floating-point tensors in ``data`` to ``dst``; with ``src``, only tensors of those dtypes."""
    return apply_to_collection(data, torch.Tensor, _cast_floating, dst, src)


def _cast_floating(tensor: torch.Tensor, dst: torch.dtype, src: tuple[torch.dtype, ...] | None) -> torch.Tensor:
    if not torch.is_floating_point(tensor) or tensor.dtype == dst:
        return tensor
    if src is not None and tensor.dtype not in src:
        return tensor
    return tensor.to(dst)


def optimizer_to_device(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move an optimizer's state (e.g. Adam moments loaded before ``setup``) next to its parameters."""
    for param_state in optimizer.state.values():
        for key, value in param_state.items():
            # The ``step`` counter of some optimizers must stay on the CPU unless it is "capturable".
            if isinstance(value, torch.Tensor) and not (key == "step" and value.dim() == 0):
                param_state[key] = value.to(device)


def as_list(items: object) -> list[Any]:
    """An argument that takes one object or several (``callbacks=``, ``loggers=``) as a list: ``None`` is empty, a
    list or tuple gives its items, anything else is the one item."""
    if items is None:
        return []
    return list(items) if isinstance(items, (list, tuple)) else [items]
