"""``fabric run model [OPTIONS] SCRIPT [SCRIPT_ARGS]...``: start a Fabric script on this node's devices.

The CLI sets environment variables and starts the processes; the script's plain ``Fabric()`` obeys
them (see :mod:`fabric.utilities.cli_contract`). Only the options given here are passed on, so the
script decides everything else. Bad input ends with one line naming the value and exit code 2.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path
from typing import Any

import click

import fabric
from fabric.accelerators.registry import accelerator_choices
from fabric.plugins.precision.registry import PRECISION_REGISTRY
from fabric.strategies.registry import strategy_choices
from fabric.utilities.cli_contract import CLI_SETTINGS
from fabric_cli.consolidate import consolidate_command
from fabric_cli.plan import (
    DEFAULT_MULTI_NODE_PORT,
    LaunchPlan,
    PlanError,
    check_node_options,
    processes_per_node,
)

_RUN_MODEL_SETTINGS = {"ignore_unknown_options": True, "allow_interspersed_args": False}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(fabric.__version__, "--version", prog_name="fabric")
def cli() -> None:
    """Fabric command line: launch Fabric scripts on several devices and nodes."""


cli.add_command(consolidate_command)


@cli.group()
def run() -> None:
    """Run something with Fabric."""


@run.command("model", context_settings=_RUN_MODEL_SETTINGS)
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--accelerator", type=click.Choice(accelerator_choices()), help="Hardware to run on. [default: auto]")
@click.option("--strategy", type=click.Choice(strategy_choices()), help="How to spread the work. [default: auto]")
@click.option(
    "--devices",
    "-n",
    "--nproc",
    help="Devices per node: a count, -1 for all, indices such as '0,1', or 'auto'. On CPU, a process count. "
    "[default: auto]",
)
@click.option("--num-nodes", "--num_nodes", type=click.IntRange(min=1), help="Number of machines. [default: 1]")
@click.option("--node-rank", "--node_rank", type=int, default=0, show_default=True, help="This machine's index.")
@click.option("--main-address", "--main_address", help="Host of node 0. [default: 127.0.0.1 on one node]")
@click.option(
    "--main-port",
    "--main_port",
    type=click.IntRange(1, 65535),
    help=f"Rendezvous port on the main address. [default: a free port on one node, {DEFAULT_MULTI_NODE_PORT} "
    "with several]",
)
@click.option(
    "--precision", type=click.Choice(PRECISION_REGISTRY.choices()), help="Numeric precision. [default: 32-true]"
)
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    help="Processes on all nodes, for uneven nodes. [default: devices x nodes]",
)
@click.option(
    "--base-rank",
    type=click.IntRange(min=0),
    help="Global rank of this node's first process. [default: node rank x devices]",
)
@click.option("-m", "--module", is_flag=True, help="Run SCRIPT as a module, like `python -m SCRIPT`.")
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where ranks other than local rank 0 write stdout/stderr. [default: runs/<timestamp>]",
)
@click.option("--dry-run", is_flag=True, help="Print what would be started, and start nothing.")
def run_model(**options: Any) -> None:
    """Run SCRIPT (a Python file, or a module with -m) in one process per device of this node.

    SCRIPT_ARGS are passed to the script untouched, even those that look like options.
    """
    try:
        plan = _make_plan(options)
    except PlanError as error:
        raise click.UsageError(str(error)) from None
    if options["dry_run"]:
        click.echo(plan.describe())
        return
    from fabric_cli.runner import run as run_plan

    sys.exit(run_plan(plan))


def _make_plan(options: dict[str, Any]) -> LaunchPlan:
    script: str = options["script"]
    if not options["module"] and not Path(script).is_file():
        raise PlanError(f"SCRIPT {script!r} is not a file. Pass a Python script, or use -m for a module.")
    accelerator = options["accelerator"] or "auto"
    processes = processes_per_node(accelerator, options["devices"] or "auto")
    num_nodes = options["num_nodes"] or 1
    node_rank = options["node_rank"]
    check_node_options(num_nodes, node_rank, options["main_address"])
    passed = {name: options[name] for name in CLI_SETTINGS if options.get(name) is not None}
    if options["devices"] is not None:
        passed["devices"] = str(processes) if accelerator == "cpu" else options["devices"]
    return LaunchPlan(
        script=script,
        script_args=tuple(options["script_args"]),
        module=options["module"],
        processes=processes,
        num_nodes=num_nodes,
        node_rank=node_rank,
        world_size=options["world_size"] or processes * num_nodes,
        base_rank=options["base_rank"] if options["base_rank"] is not None else node_rank * processes,
        main_address=options["main_address"] or "127.0.0.1",
        main_port=options["main_port"] or (_free_port() if num_nodes == 1 else DEFAULT_MULTI_NODE_PORT),
        run_dir=options["run_dir"] or Path("runs") / datetime.datetime.now().strftime("%Y-%m-%dT%H-%M-%S"),
        fabric_settings={CLI_SETTINGS[name]: str(value) for name, value in passed.items()},
    )


def _free_port() -> int:
    from fabric.plugins.environments.local import find_free_port

    return find_free_port()


def main() -> None:
    """Entry point: usage errors become one line on stderr and exit code 2, never a traceback."""
    try:
        cli.main(prog_name="fabric", standalone_mode=False)
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except click.UsageError as error:
        click.echo(f"fabric: error: {error.format_message()}", err=True)
        sys.exit(2)
    except click.Abort:
        sys.exit(130)
