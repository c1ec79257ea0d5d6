"""torchft's lighthouse served from this process: what ``fabric lighthouse`` runs (until SIGINT or SIGTERM), and what
a launcher that starts every replica group on one machine starts first (``python -m`` this module ``HOST:PORT``: until
its standard input closes).

The lighthouse is the one service a fault-tolerant run needs besides its replica groups: it forms each step's quorum
of the live groups. Once it listens, its address is printed in the form the groups take
(``TORCHFT_LIGHTHOUSE=http://host:port``), which is how a launcher knows it is up.

A launcher's lighthouse ignores SIGINT and SIGTERM: a signal sent to the whole job (Ctrl-C in a terminal, ``timeout``,
a scheduler's preemption) must not take the quorum away while the groups finish their step and save; the launcher
ends it by closing its standard input once every group has ended (or by dying: the pipe closes then too).
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType

from fabric.strategies.fault_tolerant.replica_groups import import_torchft
from fabric.utilities.cli_contract import FT_LIGHTHOUSE


class LighthouseError(Exception):
    """The lighthouse cannot listen where it was asked to (a taken port, an address not on this host)."""


def serve(
    bind: str,
    min_replicas: int = 1,
    join_timeout_ms: int = 60000,
    heartbeat_timeout_ms: int = 5000,
    until_stdin_closes: bool = False,
) -> None:
    """Listen on ``bind`` (``HOST:PORT``, port 0: any), print the address, serve until SIGINT or SIGTERM (or, with
    ``until_stdin_closes``, until the standard input closes, the signals ignored).

    A ``ValueError`` for a ``bind`` that is not ``HOST:PORT``, an ``ImportError`` without torchft, a
    :class:`LighthouseError` when it cannot listen there.
    """
    host, separator, port = bind.rpartition(":")
    if not separator or not host or not port.isdigit():
        raise ValueError(f"{bind!r} is not HOST:PORT.")
    import_torchft()
    from torchft.coordination import LighthouseServer

    try:
        server = LighthouseServer(
            bind=bind,
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
    except Exception as error:  # torchft raises its own runtime errors for a taken port or a bad address
        raise LighthouseError(f"The lighthouse cannot listen on {bind}: {error}") from None
    # torchft reports the host's name; the bound host is what the groups must reach
    print(f"{FT_LIGHTHOUSE}=http://{host}:{server.address().rpartition(':')[2]}", flush=True)
    if until_stdin_closes:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
        sys.stdin.buffer.read()  # returns at end of file: the launcher closed the pipe, or ended
    else:
        stop = threading.Event()

        def _stop(signum: int, frame: FrameType | None) -> None:
            stop.set()

        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _stop)
        stop.wait()
    server.shutdown()


if __name__ == "__main__":  # python -m fabric.strategies.fault_tolerant.lighthouse HOST:PORT: a launcher's
    try:
        serve(sys.argv[1], until_stdin_closes=True)
    except (ValueError, ImportError, LighthouseError) as error:
        sys.exit(f"fabric: error: {error}")
