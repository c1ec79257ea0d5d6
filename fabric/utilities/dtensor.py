"""A ``DTensor``'s local part, and a local tensor given a ``DTensor``'s layout: what a copied or received shard needs
to become one again."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def local_part(value: Any) -> Any:
    """This rank's part of a ``DTensor`` (its local tensor); any other value as it is."""
    to_local = getattr(value, "to_local", None)
    return value if to_local is None else to_local()


def laid_out_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` as this rank's part of a ``DTensor`` with ``like``'s mesh, placements, shape and stride (no check
    across ranks: every rank's part is known to fit)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )
