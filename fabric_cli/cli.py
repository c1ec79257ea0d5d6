"""``fabric run model [OPTIONS] SCRIPT [SCRIPT_ARGS]...``: start a Fabric script on this node's devices.

The CLI sets environment variables and starts the processes; the script's plain ``Fabric()`` obeys
them (see :mod:`fabric.utilities.cli_contract`). Only the options given here are passed on, so the
script decides everything else. Options take Lightning's names and Composer's launcher names alike,
anywhere before a ``--``, after SCRIPT only long ones (see :mod:`fabric_cli.arguments`); ``fabric run
SCRIPT`` is short for ``fabric run model SCRIPT``. Bad input ends with one line naming the value and exit code 2, before
torch is imported unless counting GPUs needs it.
"""

from __future__ import annotations

import datetime
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import click

import fabric
from fabric.accelerators.registry import accelerator_choices
from fabric.compat import DROP_IN_MODES
from fabric.plugins.precision.registry import PRECISION_REGISTRY
from fabric.strategies.registry import STRATEGY_REGISTRY, strategy_choices
from fabric.utilities.cli_contract import CLI_MESH, CLI_SETTINGS
from fabric.utilities.network import interface_for, port_in_use
from fabric.utilities.ports import find_free_port
from fabric_cli.arguments import DefaultCommandGroup, ScriptCommand
from fabric_cli.consolidate import consolidate_command
from fabric_cli.layout import Layout, LayoutError, resolve_layout
from fabric_cli.lighthouse import lighthouse_command
from fabric_cli.plan import (
    DEFAULT_MULTI_NODE_PORT,
    TEMPLATE_FIELDS,
    GroupsPlan,
    LaunchPlan,
    PlanError,
    check_node_options,
    check_template,
    local_groups,
    mesh_setting,
    parse_mesh,
    processes_per_node,
    replica_group_settings,
)

_TEMPLATE_HELP = ", ".join(f"{{{name}}}" for name in TEMPLATE_FIELDS)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(fabric.__version__, "--version", prog_name="fabric")
def cli() -> None:
    """Fabric command line: launch Fabric scripts on several devices and nodes."""


cli.add_command(consolidate_command)
cli.add_command(lighthouse_command)


@cli.group(cls=DefaultCommandGroup)
def run() -> None:
    """Run something with Fabric. `fabric run SCRIPT ...` is short for `fabric run model SCRIPT ...`."""


@run.command("model", cls=ScriptCommand)
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--accelerator", type=click.Choice(accelerator_choices()), help="Hardware to run on. [default: auto]")
@click.option("--strategy", type=click.Choice(strategy_choices()), help="How to spread the work. [default: auto]")
@click.option(
    "--devices",
    "-n",
    "--nproc",
    envvar="LOCAL_WORLD_SIZE",
    help="Devices (processes) on this node: a count, -1 for all, indices such as '0,1', or 'auto'. "
    "[default: $LOCAL_WORLD_SIZE, else auto]",
)
@click.option("--num-nodes", "--num_nodes", type=click.IntRange(min=1), help="Number of machines. [default: 1]")
@click.option(
    "--node-rank",
    "--node_rank",
    type=click.IntRange(min=0),
    envvar="NODE_RANK",
    help="This machine's index. [default: $NODE_RANK, else inferred from --base-rank, else 0]",
)
@click.option(
    "--main-address",
    "--main_address",
    "--master-addr",
    "--master_addr",
    envvar="MASTER_ADDR",
    help="Host of node 0, reachable from every node. [default: $MASTER_ADDR, else 127.0.0.1 on one node]",
)
@click.option(
    "--main-port",
    "--main_port",
    "--master-port",
    "--master_port",
    type=click.IntRange(1, 65535),
    envvar="MASTER_PORT",
    help=f"Rendezvous port on the main address. [default: $MASTER_PORT, else a free port on one node, "
    f"{DEFAULT_MULTI_NODE_PORT} with several]",
)
@click.option(
    "--precision", type=click.Choice(PRECISION_REGISTRY.choices()), help="Numeric precision. [default: 32-true]"
)
@click.option(
    "--mesh",
    help="The device mesh of an FSDP or model-parallel strategy: NAME=DEGREE pairs, e.g. "
    "data_parallel_replicate=2,data_parallel=4 (HSDP) or data_parallel=2,tensor_parallel=4; names: "
    "pipeline_parallel, data_parallel_replicate, data_parallel, context_parallel, tensor_parallel; one DEGREE may be "
    "auto. [default: the strategy's]",
)
@click.option(
    "--replica-groups",
    type=int,
    help="Make the job one replica group of a fault-tolerant run of this many groups (strategy fault_tolerant_ddp, "
    "torchft): a group that dies does not stop the others. With --replica-group (0 to N-1), the job is that group; "
    "without it, all N groups start here, each supervised on its own, with a lighthouse unless --lighthouse names one.",
)
@click.option("--replica-group", type=int, help="With --replica-groups: this group's index, 0 to N-1.")
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    help="With --replica-groups and no --replica-group: start a group that failed again, up to this many times per "
    "group; it joins the running groups and takes their state. [default: 0]",
)
@click.option(
    "--lighthouse",
    envvar="TORCHFT_LIGHTHOUSE",
    help="With --replica-groups: the torchft lighthouse, HOST:PORT (`fabric lighthouse` runs one). "
    "[default: $TORCHFT_LIGHTHOUSE]",
)
@click.option(
    "--world-size",
    "--world_size",
    type=int,
    callback=lambda ctx, param, value: _world_size(value),
    envvar="WORLD_SIZE",
    help="Processes on all nodes, for uneven nodes; -1 (Composer's default): devices x nodes. "
    "[default: $WORLD_SIZE, else devices x nodes]",
)
@click.option(
    "--base-rank",
    "--base_rank",
    type=click.IntRange(min=0),
    envvar="BASE_RANK",
    help="Global rank of this node's first process. [default: $BASE_RANK, else node rank x devices]",
)
@click.option("-m", "--module", "--module_mode", "--module-mode", is_flag=True, help="Run SCRIPT as `python -m`.")
@click.option(
    "-c",
    "--command_mode",
    "--command-mode",
    is_flag=True,
    help="Run SCRIPT as a command (an executable), not with python.",
)
@click.option(
    "--drop-in",
    "--drop_in",
    type=click.Choice(sorted(DROP_IN_MODES)),
    help="Run SCRIPT (or -m module) unchanged in a drop-in mode: `lightning` answers its `lightning.fabric` imports "
    "and `L.Fabric` with this project, `composer` its `composer` imports (as `python -m fabric.compat.NAME`).",
)
@click.option(
    "--run-dir",
    "--run_dir",
    "--run_directory",
    "--run-directory",
    type=click.Path(file_okay=False, path_type=Path),
    help="The job's directory (FABRIC_RUN_DIRECTORY for the ranks); default home of the logs of ranks other than "
    "local rank 0. [default: runs/<timestamp>-<pid>]",
)
@click.option(
    "--stdout",
    "stdout_template",
    help=f"File template for the stdout of ranks other than local rank 0, with {_TEMPLATE_HELP}. "
    "[default: RUN_DIR/rank{rank}/stdout.log]",
)
@click.option(
    "--stderr",
    "stderr_template",
    help="The same for stderr (may equal --stdout: one file). [default: RUN_DIR/rank{rank}/stderr.log]",
)
@click.option(
    "--term-timeout",
    "--term_timeout",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="Seconds the ranks get after a SIGTERM/SIGINT to the CLI is forwarded to them (e.g. to save a "
    "checkpoint), before SIGKILL.",
)
@click.option(
    "--join-timeout",
    "--join_timeout",
    type=click.FloatRange(min=0),
    default=600.0,
    show_default=True,
    help="Seconds the nodes of a multi-node job get to check in with node 0; then every waiting node fails.",
)
@click.option("-v", "--verbose", is_flag=True, help="Say what is started and how each rank ends.")
@click.option("--dry-run", is_flag=True, help="Print what would be started, and start nothing.")
def run_model(**options: Any) -> None:
    """Run SCRIPT (a Python file; a module with -m; a command with -c) in one process per device of this node.

    The options below count anywhere before a `--`; after SCRIPT only in their long form (`--devices 2`),
    since short ones after SCRIPT (`-v`, `-n 2`, `-c cfg.yaml`, `-m`) are the script's. Everything after
    `--`, and every other argument after SCRIPT, is passed to the script, with `~` and `$VAR` expanded
    (as Composer's launcher does, for arguments quoted past the shell).
    """
    try:
        plan = _make_plan(options)
    except (PlanError, LayoutError) as error:
        raise click.UsageError(str(error)) from None
    if options["dry_run"]:
        click.echo(plan.describe())
        return
    from fabric.strategies.launchers.replica_groups import LighthouseNotStarted
    from fabric_cli.join import JoinError
    from fabric_cli.replica_groups import run_groups
    from fabric_cli.runner import OutputError
    from fabric_cli.runner import run as run_plan

    try:
        sys.exit(run_groups(plan) if isinstance(plan, GroupsPlan) else run_plan(plan))
    except (JoinError, OutputError, LighthouseNotStarted) as error:
        click.echo(f"fabric: error: {error}", err=True)
        sys.exit(2 if isinstance(error, OutputError) else 1)


def _world_size(value: int | None) -> int | None:
    """``--world_size``: a count, or Composer's ``-1`` for "not given" (devices x nodes)."""
    if value is None or value == -1:
        return None
    if value < 1:
        raise click.BadParameter(
            f"{value} is not valid. Accepted: a number of processes >= 1, or -1 (devices x nodes)."
        )
    return value


def _make_plan(options: dict[str, Any]) -> LaunchPlan | GroupsPlan:
    """Check everything that needs no device count first, so most bad input never imports torch."""
    mode = _mode(options)
    check_template("--stdout", options["stdout_template"])
    check_template("--stderr", options["stderr_template"])
    check_node_options(options["num_nodes"], options["node_rank"], options["main_address"])
    mesh = None if options["mesh"] is None else parse_mesh(options["mesh"])
    accelerator = options["accelerator"] or "auto"
    processes = processes_per_node(accelerator, options["devices"] or "auto")
    layout = resolve_layout(
        processes,
        world_size=options["world_size"],
        num_nodes=options["num_nodes"] or (None if options["main_address"] else 1),  # no main address: one node
        node_rank=options["node_rank"],
        base_rank=options["base_rank"],
    )
    _check_one_process_strategy(options["strategy"], layout)
    main_address = options["main_address"] or "127.0.0.1"  # several nodes without one were refused above
    main_port = _main_port(options["main_port"], layout)
    passed = {name: options[name] for name in CLI_SETTINGS if options.get(name) is not None}
    if options["devices"] is not None:
        passed["devices"] = str(processes) if accelerator == "cpu" else options["devices"]
    settings = {CLI_SETTINGS[name]: str(value) for name, value in passed.items()}
    if mesh is not None:
        settings[CLI_MESH] = mesh_setting(mesh, layout.world_size)
    all_groups_here = options["replica_groups"] is not None and options["replica_group"] is None
    if options["max_restarts"] is not None and not all_groups_here:
        raise PlanError(
            f"--max-restarts={options['max_restarts']} restarts the replica groups this command starts, which needs "
            "--replica-groups=N without --replica-group; to restart a whole job use torchrun --max-restarts or the "
            "scheduler's requeue (with the Trainer's autoresume)."
        )
    if not all_groups_here:
        settings.update(
            replica_group_settings(
                options["replica_groups"], options["replica_group"], options["lighthouse"], options["strategy"]
            )
        )
    plan = LaunchPlan(
        script=options["script"],
        script_args=tuple(os.path.expandvars(os.path.expanduser(arg)) for arg in options["script_args"]),
        mode=mode,
        drop_in=options["drop_in"],
        layout=layout,
        main_address=main_address,
        main_port=main_port,
        run_dir=options["run_dir"] or _new_run_dir(),
        stdout_template=options["stdout_template"],
        stderr_template=options["stderr_template"],
        fabric_settings=settings,
        term_timeout=options["term_timeout"],
        join_timeout=options["join_timeout"],
        network_interface=interface_for(main_address, main_port) if layout.several_nodes else None,
        verbose=options["verbose"],
    )
    plan.check_log_files()
    if all_groups_here:
        restarts = options["max_restarts"] or 0
        return local_groups(plan, options["replica_groups"], options["lighthouse"], options["strategy"], restarts)
    return plan


def _check_one_process_strategy(strategy: str | None, layout: Layout) -> None:
    """``--strategy=single_device`` with more processes: each would crash in ``Fabric(...)`` seconds later."""
    if strategy is not None and STRATEGY_REGISTRY.canonical_name(strategy) == "single_device" and layout.world_size > 1:
        raise PlanError(
            f"--strategy={strategy} runs one process, but the job has {layout.world_size} "
            f"({layout.processes} on this node). Use --strategy=ddp (or leave --strategy out), or --devices=1."
        )


def _new_run_dir() -> Path:
    """``runs/<time>-<pid>``: jobs started in the same second from one directory (sweeps, job arrays) each get
    their own, instead of writing over each other's rank logs."""
    return Path("runs") / f"{datetime.datetime.now().strftime('%Y-%m-%dT%H-%M-%S')}-{os.getpid()}"


def _mode(options: dict[str, Any]) -> str:
    script: str = options["script"]
    if options["module"] and options["command_mode"]:
        raise PlanError("-m/--module_mode and -c/--command_mode exclude each other: pick one.")
    if options["command_mode"]:
        if options["drop_in"]:
            raise PlanError(
                f"--drop-in={options['drop_in']} runs Python code, but -c/--command_mode runs SCRIPT as a command. "
                "Pass a Python script, or -m for a module."
            )
        if shutil.which(script) is None:
            raise PlanError(f"SCRIPT {script!r} is not an executable command (-c/--command_mode).")
        return "command"
    if options["module"]:
        return "module"
    if not Path(script).is_file():
        raise PlanError(f"SCRIPT {script!r} is not a file. Pass a Python script, -m for a module, -c for a command.")
    return "script"


def _main_port(given: int | None, layout: Layout) -> int:
    if given is None and not layout.several_nodes:
        return find_free_port()
    port = given if given is not None else DEFAULT_MULTI_NODE_PORT
    if layout.hosts_join and port_in_use(port):  # this node hosts the rendezvous store on that port
        raise PlanError(f"port {port} is already in use on this machine: pick a free one with --main-port.")
    return port


def main() -> None:
    """Entry point: usage errors become one line on stderr and exit code 2, never a traceback."""
    try:
        cli.main(prog_name="fabric", standalone_mode=False)
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except click.UsageError as error:
        if error.ctx is not None and error.format_message() == error.ctx.get_help():
            click.echo(error.format_message())  # `fabric` or `fabric run` alone (click >= 8.2): help, not an error
            sys.exit(0)
        click.echo(f"fabric: error: {error.format_message()}{_environment_source(error)}", err=True)
        sys.exit(2)
    except click.ClickException as error:  # a command that cannot run (`fabric lighthouse` without torchft)
        click.echo(f"fabric: error: {error.format_message()}", err=True)
        sys.exit(error.exit_code)
    except click.Abort:
        sys.exit(130)


def _environment_source(error: click.UsageError) -> str:
    """`` (from $WORLD_SIZE)`` when the bad value came from an environment variable, not the command line."""
    param = error.param if isinstance(error, click.BadParameter) else None
    if not isinstance(param, click.Option) or not isinstance(param.envvar, str) or param.envvar not in os.environ:
        return ""
    names = [*param.opts, *param.secondary_opts]
    given = any(arg in names or arg.split("=", 1)[0] in names for arg in sys.argv[1:])
    return "" if given else f" (from ${param.envvar})"
