"""Two "machines" on one host: network namespaces joined by a veth pair, made and removed by the test itself.

Each namespace has only its loopback and its end of the pair (198.18.N.1 and 198.18.N.2, addresses reserved for
benchmarks, inside namespaces this process created), and its hostname still resolves to 127.0.0.1: the set-up
where gloo advertises loopback and the other node is refused unless told which interface to use.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from types import TracebackType

import pytest


def require_root_namespaces() -> None:
    """Fail under CI (the engine must be there), skip elsewhere, when namespaces cannot be made."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        message = "needs root and iproute2's `ip netns` to make network namespaces"
        pytest.fail(message) if os.environ.get("CI") == "true" else pytest.skip(message)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class NodePair:
    """``with NodePair() as nodes``: two namespaces; ``nodes.command(i, argv)`` runs ``argv`` on node ``i``."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.names = (f"fabA{tag}", f"fabB{tag}")
        self.interfaces = (f"fvA{tag}", f"fvB{tag}")
        self.subnet = f"198.18.{os.getpid() % 250}"

    def address(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}"

    def interface(self, node: int) -> str:
        return self.interfaces[node]

    def command(self, node: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[node], *argv]

    def __enter__(self) -> NodePair:
        require_root_namespaces()
        try:
            for name in self.names:
                _ip("netns", "add", name)
            _ip("link", "add", self.interfaces[0], "type", "veth", "peer", "name", self.interfaces[1])
            for node, (name, link) in enumerate(zip(self.names, self.interfaces, strict=True)):
                _ip("link", "set", link, "netns", name)
                _ip("-n", name, "addr", "add", f"{self.address(node)}/24", "dev", link)
                _ip("-n", name, "link", "set", link, "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as error:
            self._remove()
            raise RuntimeError(f"`ip netns` failed: {error.stderr.decode().strip()}") from error
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._remove()

    def _remove(self) -> None:
        for name in self.names:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
