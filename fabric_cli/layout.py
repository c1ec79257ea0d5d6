"""Where this node's processes sit in the job: world size, node count, node rank and base rank.

Users give any subset (Lightning's ``--num-nodes``/``--node-rank``, Composer's ``--world_size``/
``--base_rank``); the rest is inferred where only one answer exists, and any layout that cannot add
up is refused here, at parse time, instead of leaving the rendezvous to wait for ranks that never come.

Composer's form names no node count (``--world_size 3 --base_rank 2`` on a node of one process, two on the
first): the nodes may differ in size, so the count and each node's rank are left open here and decided when
the nodes join node 0 (:mod:`fabric_cli.join`), by which ranks each one starts.
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """Options that describe no possible job; the message names them and what would work."""


@dataclass(frozen=True)
class Layout:
    processes: int
    world_size: int
    #: ``None`` until the nodes join, when neither ``--num-nodes`` nor ``--node-rank`` was given.
    num_nodes: int | None
    #: ``None`` until the nodes join, on a node other than the first in that case.
    node_rank: int | None
    base_rank: int

    @property
    def ranks(self) -> range:
        return range(self.base_rank, self.base_rank + self.processes)

    @property
    def several_nodes(self) -> bool:
        return self.world_size > self.processes

    @property
    def hosts_join(self) -> bool:
        """Node 0 (the node that starts rank 0) hosts the join and, afterwards, the rendezvous."""
        return self.base_rank == 0

    def describe_nodes(self) -> str:
        """``2 node(s)); this node: rank 1`` with the parts not yet known said to be decided at join."""
        nodes = "node count decided when the nodes join" if self.num_nodes is None else f"{self.num_nodes} node(s)"
        rank = "decided when the nodes join" if self.node_rank is None else str(self.node_rank)
        return f"{nodes}); this node: rank {rank}"


def resolve_layout(
    processes: int,
    *,
    world_size: int | None = None,
    num_nodes: int | None = None,
    node_rank: int | None = None,
    base_rank: int | None = None,
) -> Layout:
    """Fill in what was not given and check that the whole job can exist."""
    world = world_size if world_size is not None else processes * (num_nodes or 1)
    if world < processes:
        raise LayoutError(f"--world-size={world} is smaller than the {processes} processes this node starts.")
    if num_nodes is None and node_rank is None and world > processes:
        base = 0 if base_rank is None else base_rank
        _check_in_world(base, processes, world)
        return Layout(processes, world, None, 0 if base == 0 else None, base)
    nodes = num_nodes if num_nodes is not None else _infer_num_nodes(processes, world)
    if nodes == 1 and world != processes:
        raise LayoutError(
            f"--world-size={world} does not match the {processes} processes of a single node: pass "
            f"--world-size={processes}, or --num-nodes and --main-address to run the other ranks elsewhere."
        )
    if world < processes + nodes - 1:
        raise LayoutError(
            f"--world-size={world} is too small for {nodes} nodes: this node starts {processes} processes and "
            f"each of the other {nodes - 1} needs at least one (world size >= {processes + nodes - 1})."
        )
    if base_rank is not None:
        _check_in_world(base_rank, processes, world)
    node = node_rank if node_rank is not None else _infer_node_rank(processes, world, nodes, base_rank)
    if not 0 <= node < nodes:
        raise LayoutError(f"--node-rank={node} is outside [0, {nodes}) for {nodes} node(s).")
    base = base_rank if base_rank is not None else _infer_base_rank(processes, world, nodes, node)
    _check_base_rank(processes, world, nodes, node, base)
    return Layout(processes, world, nodes, node, base)


def _infer_num_nodes(processes: int, world: int) -> int:
    if world % processes:
        raise LayoutError(
            f"--world-size={world} is not a multiple of the {processes} processes this node starts, so the nodes "
            "differ in size: pass --num-nodes (and --base-rank on nodes other than the first and the last)."
        )
    return world // processes


def _infer_node_rank(processes: int, world: int, nodes: int, base_rank: int | None) -> int:
    if base_rank is None or base_rank == 0:
        return 0
    if base_rank + processes == world:
        return nodes - 1
    if world == nodes * processes and base_rank % processes == 0:
        return base_rank // processes
    raise LayoutError(f"--base-rank={base_rank} does not tell which node this is: pass --node-rank as well.")


def _infer_base_rank(processes: int, world: int, nodes: int, node: int) -> int:
    if node == 0:
        return 0
    if node == nodes - 1:
        return world - processes
    if world == nodes * processes:
        return node * processes
    raise LayoutError(
        f"--world-size={world} over {nodes} nodes means nodes of different sizes, so node {node}'s first rank "
        "is unknown: pass --base-rank."
    )


def _check_base_rank(processes: int, world: int, nodes: int, node: int, base: int) -> None:
    _check_in_world(base, processes, world)
    last = base + processes - 1
    if node == 0 and base != 0:
        raise LayoutError(f"--base-rank={base} on node 0: node 0 runs rank 0 (it hosts the rendezvous), so 0.")
    if node > 0 and base < node:
        raise LayoutError(
            f"--base-rank={base} on node {node}: the {node} node(s) before it hold at least one rank each."
        )
    if node == nodes - 1 and last != world - 1:
        raise LayoutError(
            f"--base-rank={base} on the last node ({node}) leaves ranks {last + 1}..{world - 1} of "
            f"--world-size={world} on no node."
        )
    if node < nodes - 1 and last + (nodes - 1 - node) > world - 1:
        raise LayoutError(
            f"--base-rank={base} on node {node} leaves fewer than one rank each for the {nodes - 1 - node} "
            f"node(s) after it (--world-size={world})."
        )


def _check_in_world(base: int, processes: int, world: int) -> None:
    last = base + processes - 1
    if base < 0 or last >= world:
        raise LayoutError(
            f"--base-rank={base} puts this node's {processes} processes at ranks {base}..{last}, outside "
            f"the world of {world} (ranks 0..{world - 1})."
        )
