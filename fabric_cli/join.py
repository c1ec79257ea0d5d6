"""Multi-node join: every node's CLI checks in with node 0's before any rank starts.

Node 0's CLI listens on the main port (rank 0's rendezvous store takes the port over afterwards), the
other nodes' CLIs connect and announce their part of the layout. Once the nodes add up to the world
size, node 0 answers ``go`` to all and every node starts its ranks. If a node has not joined within
``--join-timeout`` seconds, or a node's layout contradicts another's, every waiting node fails with one
line naming who is missing or what disagrees, instead of ranks waiting half an hour in the rendezvous.
"""

from __future__ import annotations

import contextlib
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


def join(layout: Layout, address: str, port: int, timeout: float) -> None:
    """Return once every node has joined; raise :class:`JoinError` within about ``timeout`` seconds otherwise."""
    if layout.num_nodes == 1:
        return
    if layout.node_rank == 0:
        _host(layout, port, timeout)
    else:
        _check_in(layout, address, port, timeout)


def _host(layout: Layout, port: int, timeout: float) -> None:
    """Accept join messages until the nodes add up and each of them is still there; then answer ``go``.

    A connection that sends no valid join message (a port scan, a health check, a stale rank) is dropped and
    ignored; a node that joined and then went away is dropped before ``go``, so it may join again.
    """
    deadline = time.monotonic() + timeout
    joined: dict[int, Layout] = {0: layout}
    links: dict[int, socket.socket] = {}
    try:
        server = _listen(port)
        with server:
            while True:
                _forget_gone_nodes(joined, links)
                if len(joined) == layout.num_nodes:
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
                if other.node_rank in links and not _still_there(links[other.node_rank]):
                    _forget(other.node_rank, joined, links)  # it restarted: the new connection replaces the old
                try:
                    _check_agreement(layout, joined, other)
                except JoinError as error:
                    _send_all([connection], f"abort {error}")
                    connection.close()
                    raise
                links[other.node_rank] = connection
                joined[other.node_rank] = other
            _check_coverage(layout, joined)
        _send_all(list(links.values()), "go")
    except JoinError as error:
        _send_all(list(links.values()), f"abort {error}")
        raise
    finally:
        for connection in links.values():
            connection.close()


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
        fields = json.loads(_read_line(connection))
        return Layout(**{name: int(fields[name]) for name in Layout.__dataclass_fields__})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _check_agreement(layout: Layout, joined: dict[int, Layout], other: Layout) -> None:
    node = other.node_rank
    if (other.world_size, other.num_nodes) != (layout.world_size, layout.num_nodes):
        raise JoinError(
            f"node {node} has --world-size={other.world_size} --num-nodes={other.num_nodes}, node 0 has "
            f"--world-size={layout.world_size} --num-nodes={layout.num_nodes}: give every node the same."
        )
    if node in joined:
        raise JoinError(f"two nodes call themselves node {node}: give each node its own --node-rank.")
    for known in joined.values():
        if set(known.ranks) & set(other.ranks):
            raise JoinError(
                f"node {node} (ranks {other.ranks[0]}..{other.ranks[-1]}) and node {known.node_rank} (ranks "
                f"{known.ranks[0]}..{known.ranks[-1]}) overlap: fix --base-rank or --devices."
            )


def _check_coverage(layout: Layout, joined: dict[int, Layout]) -> None:
    covered = {rank for node in joined.values() for rank in node.ranks}
    unassigned = [rank for rank in range(layout.world_size) if rank not in covered]
    if unassigned:
        raise JoinError(
            f"every node joined, but ranks {', '.join(map(str, unassigned))} of --world-size={layout.world_size} "
            "are on no node: fix --devices or --base-rank."
        )


def _missing(layout: Layout, joined: dict[int, Layout], port: int, timeout: float) -> JoinError:
    missing = [node for node in range(layout.num_nodes) if node not in joined]
    return JoinError(
        f"node(s) {', '.join(map(str, missing))} did not join within --join-timeout={timeout:g} s (joined: "
        f"{', '.join(map(str, sorted(joined)))}). Start `fabric run model` there with their --node-rank, the same "
        f"--main-address and --main-port={port}, and check they can reach this machine on that port."
    )


def _check_in(layout: Layout, address: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    message = json.dumps({name: getattr(layout, name) for name in Layout.__dataclass_fields__}) + "\n"
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
    if answer != "go":
        raise JoinError(answer.removeprefix("abort ") if answer else f"node 0 at {address}:{port} hung up.")


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
