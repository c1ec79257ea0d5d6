"""Rank-zero helpers, re-exported from lightning-utilities, plus the one place the rank is recorded.

``rank_zero_only`` decorates functions that must run on global rank 0 only (printing, logging).
Fabric calls :func:`set_global_rank` once it knows this process's rank; the rank is a property of
the process, so it is shared with any other library built on lightning-utilities.
"""

from __future__ import annotations

import os

from lightning_utilities.core.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn

# Until Fabric records it, assume the rank a launcher (torchrun, the CLI) put in the environment, so
# rank-zero helpers used outside Fabric work instead of raising.
if getattr(rank_zero_only, "rank", None) is None:
    rank_zero_only.rank = int(os.environ.get("RANK", 0))  # type: ignore[attr-defined]


def set_global_rank(rank: int) -> None:
    """Record this process's global rank for every ``rank_zero_only`` function."""
    rank_zero_only.rank = rank  # type: ignore[attr-defined]


__all__ = ["rank_zero_info", "rank_zero_only", "rank_zero_warn", "set_global_rank"]
