"""``fabric lighthouse [--bind HOST:PORT] [--min-replicas N]``: run torchft's lighthouse until interrupted.

The lighthouse is the one service a fault-tolerant run (``strategy="fault_tolerant_ddp"``) needs besides its replica
groups: it forms each step's quorum of the live groups. This command starts torchft's own server in this process,
prints its address in the form the groups take (``TORCHFT_LIGHTHOUSE=http://host:port``) and serves until SIGINT or
SIGTERM. It binds 127.0.0.1 unless told otherwise; on a cluster bind an address the groups' nodes reach.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType

import click

from fabric.utilities.cli_contract import FT_LIGHTHOUSE


@click.command("lighthouse")
@click.option("--bind", default="127.0.0.1:29510", show_default=True, help="HOST:PORT to listen on (port 0: any).")
@click.option(
    "--min-replicas",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="The fewest replica groups a quorum may have: the first step waits for this many.",
)
@click.option(
    "--join-timeout-ms",
    type=click.IntRange(min=0),
    default=60000,
    show_default=True,
    help="How long a quorum waits for groups that are alive but have not asked to join yet.",
)
@click.option(
    "--heartbeat-timeout-ms",
    type=click.IntRange(min=1),
    default=5000,
    show_default=True,
    help="After this long without a heartbeat a replica group is taken for dead.",
)
def lighthouse_command(bind: str, min_replicas: int, join_timeout_ms: int, heartbeat_timeout_ms: int) -> None:
    """Run torchft's lighthouse for fault-tolerant replica groups until SIGINT or SIGTERM."""
    host, separator, port = bind.rpartition(":")
    if not separator or not host or not port.isdigit():
        raise click.BadParameter(f"{bind!r} is not HOST:PORT.", param_hint="--bind")
    from fabric.strategies.fault_tolerant.replica_groups import import_torchft

    try:
        import_torchft()
        from torchft.coordination import LighthouseServer
    except ImportError as error:
        raise click.ClickException(str(error)) from None
    try:
        server = LighthouseServer(
            bind=bind,
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
    except Exception as error:  # torchft raises its own runtime errors for a taken port or a bad address
        raise click.ClickException(f"The lighthouse cannot listen on {bind}: {error}") from None
    # torchft reports the host's name; the bound host is what the groups must reach
    address = f"http://{host}:{server.address().rpartition(':')[2]}"
    click.echo(f"{FT_LIGHTHOUSE}={address}")
    sys.stdout.flush()  # a launcher reads the address from a pipe
    stop = threading.Event()

    def _stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _stop)
    stop.wait()
    server.shutdown()
