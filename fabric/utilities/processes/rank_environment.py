"""The variables a started rank reads to find its place in the job, and the thread rule: one home for
``strategy="ddp"``, ``ddp_spawn`` and ``fabric run`` (torch-free: the CLI uses it)."""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping


def rank_variables(
    *,
    main_address: str,
    main_port: int,
    world_size: int,
    local_world_size: int,
    local_rank: int,
    global_rank: int,
    node_rank: int | None = None,
    num_nodes: int | None = None,
) -> dict[str, str]:
    """``MASTER_ADDR``/``MASTER_PORT``, ``WORLD_SIZE``/``LOCAL_WORLD_SIZE``, ``LOCAL_RANK``/``RANK`` and, when
    given, ``NODE_RANK`` and the node count ``GROUP_WORLD_SIZE`` (torchrun's name): what ``Fabric()`` in a
    started rank joins the job with instead of launching again. The node count is the one fact an uneven job
    (nodes of different sizes) cannot be told by the other variables."""
    variables = {"MASTER_ADDR": main_address, "MASTER_PORT": str(main_port)}
    if node_rank is not None:
        variables["NODE_RANK"] = str(node_rank)
    if num_nodes is not None:
        variables["GROUP_WORLD_SIZE"] = str(num_nodes)
    variables.update(
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(local_world_size),
        LOCAL_RANK=str(local_rank),
        RANK=str(global_rank),
    )
    return variables


def thread_defaults(local_world_size: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``OMP_NUM_THREADS``: this node's cores shared among its ranks instead of oversubscribed, unless set."""
    if "OMP_NUM_THREADS" in environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // local_world_size))}


def export_variables(
    variables: Mapping[str, str], environ: MutableMapping[str, str] = os.environ
) -> dict[str, str | None]:
    """Set ``variables`` in this process; returns their previous values (``None``: unset) for
    :func:`restore_variables`."""
    previous = {name: environ.get(name) for name in variables}
    environ.update(variables)
    return previous


def restore_variables(previous: Mapping[str, str | None], environ: MutableMapping[str, str] = os.environ) -> None:
    """Put back what :func:`export_variables` replaced."""
    for name, value in previous.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
