"""``format_name_with_dist_and_time``: Composer's file name templates, filled with this process's place in the world
and the training clock (``composer.utils.format_name_with_dist_and_time``, which llm-foundry uses for its folders)."""

from __future__ import annotations

from typing import Any

from fabric.trainer.core.time import Timestamp
from fabric.trainer.dist import get_global_rank, get_local_rank, get_local_world_size, get_node_rank, get_world_size


def format_name_with_dist_and_time(
    format_str: str, run_name: str, timestamp: Timestamp, **extra_format_kwargs: Any
) -> str:
    """``format_str`` with Composer's fields filled: ``{run_name}``, ``{rank}``, ``{local_rank}``, ``{world_size}``,
    ``{local_world_size}``, ``{node_rank}``, the clock's ``{epoch}``, ``{batch}``, ``{sample}``, ``{token}``, their
    ``_in_epoch`` counts, ``{total_wct}``, ``{epoch_wct}``, ``{batch_wct}`` (seconds), and ``extra_format_kwargs``.
    A field outside these is a ``KeyError`` naming it, as ``str.format`` raises."""
    fields: dict[str, Any] = {
        "run_name": run_name,
        "rank": get_global_rank(),
        "local_rank": get_local_rank(),
        "world_size": get_world_size(),
        "local_world_size": get_local_world_size(),
        "node_rank": get_node_rank(),
        **{name: int(getattr(timestamp, name)) for name in ("epoch", "batch", "sample", "token")},
        **{f"{name}_in_epoch": int(getattr(timestamp, f"{name}_in_epoch")) for name in ("batch", "sample", "token")},
        **{name: getattr(timestamp, name).total_seconds() for name in ("total_wct", "epoch_wct", "batch_wct")},
    }
    return format_str.format(**fields, **extra_format_kwargs)
