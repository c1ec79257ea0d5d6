"""Network checks the CLI makes before starting anything (torch-free, instant)."""

from __future__ import annotations

import errno
import socket


def port_in_use(port: int) -> bool:
    """Whether a listening socket already holds ``port`` on this machine (IPv4 or IPv6), as rank 0's
    rendezvous store would find when it binds it on every interface."""
    for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this machine
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store does: TIME_WAIT is no clash
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind((address, port))
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    return True
    return False
