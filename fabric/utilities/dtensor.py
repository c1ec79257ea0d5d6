"""A local tensor given the layout of a ``DTensor``: what a copied or received shard needs to become one again."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def laid_out_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` as this rank's part of a ``DTensor`` with ``like``'s mesh, placements, shape and stride (no check
    across ranks: every rank's part is known to fit)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )
