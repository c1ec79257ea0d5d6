"""``fabric lighthouse [--bind HOST:PORT] [--min-replicas N]``: run torchft's lighthouse until interrupted.

The lighthouse is the one service a fault-tolerant run (``strategy="fault_tolerant_ddp"``) needs besides its replica
groups: it forms each step's quorum of the live groups. This command starts torchft's own server in this process
(:func:`fabric.strategies.fault_tolerant.lighthouse.serve`), prints its address in the form the groups take
(``TORCHFT_LIGHTHOUSE=http://host:port``) and serves until SIGINT or SIGTERM. It binds 127.0.0.1 unless told
otherwise; on a cluster bind an address the groups' nodes reach.
"""

from __future__ import annotations

import click


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
    from fabric.strategies.fault_tolerant.lighthouse import LighthouseError, serve

    try:
        serve(bind, min_replicas, join_timeout_ms, heartbeat_timeout_ms)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--bind") from None
    except (ImportError, LighthouseError) as error:
        raise click.ClickException(str(error)) from None
