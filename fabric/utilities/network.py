"""Network facts a launch needs (torch-free, instant): whether a port is taken, which interface reaches a host."""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Mapping

#: The variables naming the interface that gloo and NCCL bind their sockets to.
SOCKET_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


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


def interface_for(address: str, port: int) -> str | None:
    """The name of this machine's network interface whose address routes to ``address`` (Linux), or
    ``None`` when that is loopback or cannot be told. Gloo and NCCL bind to what the hostname resolves
    to unless told an interface, and in containers and network namespaces that is often 127.0.0.1,
    which no other node can reach."""
    try:
        family, _, _, _, target = socket.getaddrinfo(address, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(target)  # UDP: picks the route and source address, sends nothing
            source = probe.getsockname()[0]
    except OSError:
        return None
    if family != socket.AF_INET or source.startswith("127."):
        return None
    return next((name for _, name in socket.if_nameindex() if _ipv4_address(name) == source), None)


def socket_interface_defaults(address: str, port: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """:data:`SOCKET_INTERFACE_VARIABLES` naming the interface that routes to ``address``, for those not set in
    ``environ``; empty when that is loopback or cannot be told. Without them, ranks on hosts whose name resolves
    to loopback advertise 127.0.0.1 and the other nodes are refused (``connectFullMesh ... Connection refused``)."""
    interface = interface_for(address, port)
    if interface is None:
        return {}
    return {name: interface for name in SOCKET_INTERFACE_VARIABLES if name not in environ}


def _ipv4_address(interface: str) -> str | None:
    """The IPv4 address of ``interface`` (``SIOCGIFADDR``), or ``None``."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            answer = fcntl.ioctl(sock.fileno(), siocgifaddr, struct.pack("256s", interface.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(answer[20:24])
