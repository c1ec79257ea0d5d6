"""Multi-node join: every node's CLI checks in with node 0's before any rank starts.

Node 0's CLI (the one that starts rank 0) listens on the main port (rank 0's rendezvous store takes the
port over afterwards), the other nodes' CLIs connect and announce their part of the layout. Once the nodes
add up (to ``--num-nodes``, or, when no node count was given, to ranks covering the whole world), node 0
answers ``go`` to all, with each node's rank and the node count where they were left open (nodes numbered
by their first rank), and every node starts its ranks. If a node has not joined within ``--join-timeout``
seconds, or a node's layout contradicts another's, every waiting node fails with one line naming who is
missing or what disagrees, instead of ranks waiting half an hour in the rendezvous.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import time

from fabric_cli.layout import Layout

_RETRY_SECONDS = 0.2
# Once connected, a node waits this much longer than its own --join-timeout for node 0's answer: node 0
# answers by its own deadline, which started before this node connected but may be late on a loaded machine.
_ANSWER_GRACE_SECONDS = 10.0
#: How long node 0 waits for a new connection's join message, which a node sends as soon as it connects.
_MESSAGE_SECONDS = 5.0


class JoinError(RuntimeError):
    """The nodes could not all join: the message says who is missing or what disagrees, and what to check."""


def join(layout: Layout, address: str, port: int, timeout: float) -> Layout:
    """Return this node's layout, complete, once every node has joined; raise :class:`JoinError` within about
    ``timeout`` seconds otherwise."""
    if not layout.several_nodes:
        return layout
    if layout.hosts_join:
        return _host(layout, port, timeout)
    return _check_in(layout, address, port, timeout)


def _host(layout: Layout, port: int, timeout: float) -> Layout:
    """Accept join messages until the nodes add up and each of them is still there; then answer ``go``.

    Nodes are known by their first rank. A connection that sends no valid join message (a port scan, a health
    check, a stale rank) is dropped and ignored; a node that joined and then went away is dropped before
    ``go``, so it may join again.
    """
    deadline = time.monotonic() + timeout
    joined: dict[int, Layout] = {0: layout}
    links: dict[int, socket.socket] = {}
    try:
        server = _listen(port)
        with server:
            while True:
                _forget_gone_nodes(joined, links)
                if _all_joined(layout, joined):
                    break
                server.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    connection, _ = server.accept()
                except TimeoutError:
                    raise _missing(layout, joined, port, timeout) from None
                other = _read_layout(connection, deadline)
                if other is None:
                    connection.close()
                    continue
                if other.base_rank in links and not _still_there(links[other.base_rank]):
                    _forget(other.base_rank, joined, links)  # it restarted: the new connection replaces the old
                try:
                    _check_agreement(layout, joined, other)
                except JoinError as error:
                    _send_all([connection], f"abort {error}")
                    connection.close()
                    raise
                links[other.base_rank] = connection
                joined[other.base_rank] = other
            _check_coverage(layout, joined)
        completed = _number_nodes(joined)
        for base_rank, link in links.items():
            _send_all([link], "go " + json.dumps(_fields(completed[base_rank])))
    except JoinError as error:
        _send_all(list(links.values()), f"abort {error}")
        raise
    finally:
        for connection in links.values():
            connection.close()
    return completed[0]


def _all_joined(layout: Layout, joined: dict[int, Layout]) -> bool:
    """``--num-nodes`` nodes, or, with no node count given, nodes whose ranks cover the world (they never
    overlap: :func:`_check_agreement` refuses that)."""
    if layout.num_nodes is not None:
        return len(joined) == layout.num_nodes
    return sum(node.processes for node in joined.values()) == layout.world_size


def _number_nodes(joined: dict[int, Layout]) -> dict[int, Layout]:
    """Each node's layout with the node count and its node rank filled in: nodes in the order of their ranks."""
    return {
        base_rank: dataclasses.replace(
            node,
            num_nodes=len(joined),
            node_rank=position if node.node_rank is None else node.node_rank,
        )
        for position, (base_rank, node) in enumerate(sorted(joined.items()))
    }


def _forget_gone_nodes(joined: dict[int, Layout], links: dict[int, socket.socket]) -> None:
    for node in [node for node, link in links.items() if not _still_there(link)]:
        _forget(node, joined, links)


def _forget(node: int, joined: dict[int, Layout], links: dict[int, socket.socket]) -> None:
    links.pop(node).close()
    joined.pop(node, None)


def _still_there(link: socket.socket) -> bool:
    """Whether the node behind ``link`` has not hung up (it sends nothing more until node 0 answers)."""
    link.setblocking(False)
    try:
        return link.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True  # open, nothing to read: still waiting for the answer
    except OSError:
        return False
    finally:
        link.setblocking(True)


def _listen(port: int) -> socket.socket:
    try:
        return socket.create_server(("", port))
    except OSError as error:
        raise JoinError(
            f"node 0 cannot listen on port {port} ({error.strerror}): is another node 0 running here? Pick a free "
            "port with --main-port."
        ) from None


def _read_layout(connection: socket.socket, deadline: float) -> Layout | None:
    """The layout a joining node announces, or ``None`` for a connection that sends no valid join message
    within :data:`_MESSAGE_SECONDS` (a node sends it as soon as it connects)."""
    connection.settimeout(max(0.01, min(_MESSAGE_SECONDS, deadline - time.monotonic())))
    try:
        return _layout_from(json.loads(_read_line(connection)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _fields(layout: Layout) -> dict[str, int | None]:
    return {name: getattr(layout, name) for name in Layout.__dataclass_fields__}


def _layout_from(fields: dict[str, object]) -> Layout:
    """The layout a join message or an answer carries; ``ValueError``/``TypeError``/``KeyError`` if malformed."""
    open_fields = ("num_nodes", "node_rank")  # may still be decided at join
    values = {
        name: None if fields[name] is None and name in open_fields else int(fields[name])  # type: ignore[call-overload]
        for name in Layout.__dataclass_fields__
    }
    return Layout(**values)  # type: ignore[arg-type]


def _check_agreement(layout: Layout, joined: dict[int, Layout], other: Layout) -> None:
    if (other.world_size, other.num_nodes) != (layout.world_size, layout.num_nodes):
        raise JoinError(f"{_name(other)} has {_sizes(other)}, node 0 has {_sizes(layout)}: give every node the same.")
    if other.node_rank is not None and any(known.node_rank == other.node_rank for known in joined.values()):
        raise JoinError(f"two nodes call themselves node {other.node_rank}: give each node its own --node-rank.")
    for known in joined.values():
        if set(known.ranks) & set(other.ranks):
            raise JoinError(f"{_name(other)} and {_name(known)} overlap: fix --base-rank or --devices.")


def _name(node: Layout) -> str:
    """``node 1 (ranks 2..3)``, or ``the node of ranks 2..3`` while its node rank is open."""
    ranks = f"ranks {node.ranks[0]}..{node.ranks[-1]}"
    return f"the node of {ranks}" if node.node_rank is None else f"node {node.node_rank} ({ranks})"


def _sizes(node: Layout) -> str:
    count = "no --num-nodes" if node.num_nodes is None else f"--num-nodes={node.num_nodes}"
    return f"--world-size={node.world_size} {count}"


def _check_coverage(layout: Layout, joined: dict[int, Layout]) -> None:
    covered = {rank for node in joined.values() for rank in node.ranks}
    unassigned = [rank for rank in range(layout.world_size) if rank not in covered]
    if unassigned:
        raise JoinError(
            f"every node joined, but ranks {', '.join(map(str, unassigned))} of --world-size={layout.world_size} "
            "are on no node: fix --devices or --base-rank."
        )


def _missing(layout: Layout, joined: dict[int, Layout], port: int, timeout: float) -> JoinError:
    if layout.num_nodes is None:
        covered = {rank for node in joined.values() for rank in node.ranks}
        absent = [rank for rank in range(layout.world_size) if rank not in covered]
        who = f"no node with ranks {_spans(absent)} of --world-size={layout.world_size} joined"
        present = ", ".join(_name(node) for node in joined.values())
        there = "there"
    else:
        node_ranks = sorted(node.node_rank for node in joined.values() if node.node_rank is not None)
        missing = [node for node in range(layout.num_nodes) if node not in node_ranks]
        who = f"node(s) {', '.join(map(str, missing))} did not join"
        present = ", ".join(map(str, node_ranks))
        there = "there with their --node-rank,"
    return JoinError(
        f"{who} within --join-timeout={timeout:g} s (joined: {present}). Start `fabric run model` {there} the same "
        f"--main-address and --main-port={port}, and check they can reach this machine on that port."
    )


def _spans(ranks: list[int]) -> str:
    """``2..4, 7`` for ranks 2, 3, 4 and 7."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and spans[-1][-1] == rank - 1:
            spans[-1].append(rank)
        else:
            spans.append([rank])
    return ", ".join(str(span[0]) if len(span) == 1 else f"{span[0]}..{span[-1]}" for span in spans)


def _check_in(layout: Layout, address: str, port: int, timeout: float) -> Layout:
    deadline = time.monotonic() + timeout
    message = json.dumps(_fields(layout)) + "\n"
    while True:
        try:
            with socket.create_connection((address, port), timeout=max(0.01, deadline - time.monotonic())) as link:
                link.sendall(message.encode())
                link.settimeout(timeout + _ANSWER_GRACE_SECONDS)
                answer = _read_line(link)
                break
        except (ConnectionRefusedError, TimeoutError) as error:
            if time.monotonic() >= deadline:
                raise JoinError(
                    f"node 0 at {address}:{port} did not answer within --join-timeout={timeout:g} s ({error}): start "
                    "it, and check --main-address, --main-port and that this machine can reach it."
                ) from None
            time.sleep(_RETRY_SECONDS)
        except OSError as error:
            raise JoinError(f"cannot join node 0 at {address}:{port}: {error}.") from None
    if not answer.startswith("go "):
        raise JoinError(answer.removeprefix("abort ") if answer else f"node 0 at {address}:{port} hung up.")
    return _layout_from(json.loads(answer.removeprefix("go ")))


def _read_line(connection: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.decode().strip()


def _send_all(connections: list[socket.socket], line: str) -> None:
    for connection in connections:
        with contextlib.suppress(OSError):  # that node is gone; it fails on its own
            connection.sendall(f"{line}\n".encode())
