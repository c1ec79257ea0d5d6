"""Free TCP ports (stdlib only: the CLI uses this before, and without, importing torch)."""

from __future__ import annotations

import socket


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the OS picks it when binding to port 0).

    Another program could take the port before it is used; callers should use it promptly.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port
