"""What ``fabric run model`` will start: the validated launch plan and each rank's environment.

Everything here is torch-free, so ``--help``, ``--dry-run`` and bad input answer instantly; torch is
imported only to count GPUs when the user asks for GPUs.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path

from fabric.compat import DROP_IN_MODES
from fabric.strategies.fault_tolerant.plan import EveryGroupHere, resolve_launch
from fabric.strategies.mesh import MeshPlan
from fabric.utilities.cli_contract import (
    CLI_MARKER,
    CLI_MESH,
    CLI_SETTINGS,
    FT_LIGHTHOUSE,
    FT_REPLICA_GROUP,
    FT_REPLICA_GROUPS,
    RUN_DIRECTORY_VARIABLE,
)
from fabric.utilities.device_parser import ALL, AUTO, cpu_oversubscription, parse_devices
from fabric.utilities.network import SOCKET_INTERFACE_VARIABLES
from fabric.utilities.ports import find_free_port
from fabric.utilities.processes.rank_environment import rank_variables, thread_defaults
from fabric_cli.layout import Layout

#: torchrun's default rendezvous port, used when several nodes must agree on one.
DEFAULT_MULTI_NODE_PORT = 29500

#: Fields a ``--stdout``/``--stderr`` file template may use.
TEMPLATE_FIELDS = ("rank", "local_rank", "node_rank", "world_size", "local_world_size", "run_dir")

#: Set for the ranks unless the user's environment already sets them (as Composer's launcher does).
RANK_DEFAULTS = {"PYTHONUNBUFFERED": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


class PlanError(ValueError):
    """An option value that cannot work; the message names the value and what is accepted."""


def parse_mesh(text: str) -> MeshPlan:
    """``--mesh`` read (before anything counts devices, so bad input answers at once)."""
    try:
        return MeshPlan.parse(text)
    except ValueError as error:
        raise PlanError(f"--mesh={text}: {error}") from None


def mesh_setting(plan: MeshPlan, world_size: int) -> str:
    """The mesh checked against the job's world size, as the ranks will read it (:data:`CLI_MESH`)."""
    try:
        plan.resolve(world_size)
    except ValueError as error:
        raise PlanError(f"--mesh={plan.as_text()}: {error}") from None
    return plan.as_text()


#: The strategies ``--replica-groups`` runs: full copies in each group (the default) or FSDP2 shard groups.
FAULT_TOLERANT_STRATEGIES = ("fault_tolerant_ddp", "fault_tolerant_fsdp")


def replica_group_settings(
    replica_groups: int | None, replica_group: int | None, lighthouse: str | None, strategy: str | None
) -> dict[str, str]:
    """The variables that make this job one replica group of a fault-tolerant run (``--replica-groups``,
    ``--replica-group``, ``--lighthouse``), checked as ``Fabric()`` will check them; nothing when none is given."""
    if replica_groups is None and replica_group is None:
        return {}
    if strategy is not None and strategy not in FAULT_TOLERANT_STRATEGIES:
        accepted = " or ".join(f"--strategy={name}" for name in FAULT_TOLERANT_STRATEGIES)
        raise PlanError(
            f"--replica-groups makes the job one replica group of a fault-tolerant run, which needs {accepted}; "
            f"got --strategy={strategy}. Leave --strategy out (the first) or pass one of them."
        )
    try:
        plan = resolve_launch(replica_group, replica_groups, lighthouse=lighthouse, environment={})
        if isinstance(plan, EveryGroupHere):  # local_groups gives each group its index
            raise plan.unplaced_error()
    except ValueError as error:  # the same message, in the options' names
        message = re.sub(r"\breplica_group(s?)\b", r"--replica-group\1", str(error))
        message = re.sub(r"\blighthouse='host:port'|\blighthouse=", "--lighthouse=", message)
        raise PlanError(message.replace("--lighthouse= or set", "--lighthouse=HOST:PORT or set")) from None
    return {
        FT_REPLICA_GROUP: str(plan.replica_group),
        FT_REPLICA_GROUPS: str(plan.replica_groups),
        FT_LIGHTHOUSE: plan.lighthouse,
        CLI_SETTINGS["strategy"]: strategy or FAULT_TOLERANT_STRATEGIES[0],
    }


@dataclass(frozen=True)
class LaunchPlan:
    """The processes this node starts and the variables each one gets."""

    script: str
    script_args: tuple[str, ...]
    #: ``"script"`` (``python SCRIPT``), ``"module"`` (``python -m SCRIPT``) or ``"command"`` (``SCRIPT`` itself).
    mode: str
    #: The drop-in mode SCRIPT runs in (``fabric.compat.DROP_IN_MODES``), or ``None``.
    drop_in: str | None
    layout: Layout
    main_address: str
    main_port: int
    run_dir: Path
    #: ``--stdout``/``--stderr`` file templates for ranks other than local rank 0; ``None``: the run dir.
    stdout_template: str | None = None
    stderr_template: str | None = None
    #: ``FABRIC_*`` variables for the options the user actually passed, and nothing else.
    fabric_settings: dict[str, str] = field(default_factory=dict)
    #: Seconds the ranks get to exit after a SIGTERM/SIGINT to the CLI is forwarded to them, before SIGKILL.
    term_timeout: float = 30.0
    #: Seconds the nodes of a multi-node job get to check in with node 0 before any rank starts.
    join_timeout: float = 600.0
    #: The interface the ranks' gloo/NCCL sockets use (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``) unless set.
    network_interface: str | None = None
    verbose: bool = False

    @property
    def processes(self) -> int:
        return self.layout.processes

    def command(self) -> list[str]:
        prefix = {"script": [sys.executable], "module": [sys.executable, "-m"], "command": []}[self.mode]
        if self.drop_in is not None:  # python -m fabric.compat.NAME [-m] SCRIPT
            prefix = [sys.executable, "-m", DROP_IN_MODES[self.drop_in], *prefix[1:]]
        return [*prefix, self.script, *self.script_args]

    def global_rank(self, local_rank: int) -> int:
        return self.layout.base_rank + local_rank

    def rank_environment(self, local_rank: int) -> dict[str, str]:
        """The variables (on top of the inherited ones) that tell ``Fabric()`` where this rank sits."""
        layout = self.layout
        variables = {
            CLI_MARKER: "1",
            **self.fabric_settings,
            **self._node_count_setting(),
            RUN_DIRECTORY_VARIABLE: str(self.run_dir.absolute()),
            **rank_variables(
                main_address=self.main_address,
                main_port=self.main_port,
                node_rank=layout.node_rank,
                num_nodes=layout.num_nodes,
                world_size=layout.world_size,
                local_world_size=layout.processes,
                local_rank=local_rank,
                global_rank=self.global_rank(local_rank),
            ),
        }
        defaults = dict(RANK_DEFAULTS)
        if self.network_interface is not None:
            defaults.update(dict.fromkeys(SOCKET_INTERFACE_VARIABLES, self.network_interface))
        variables.update({name: value for name, value in defaults.items() if name not in os.environ})
        variables.update(thread_defaults(layout.processes))
        return variables

    def _node_count_setting(self) -> dict[str, str]:
        """``Fabric(num_nodes=)`` for a job of several nodes, once the count is known (after the join)."""
        nodes = self.layout.num_nodes
        return {CLI_SETTINGS["num_nodes"]: str(nodes)} if nodes is not None and nodes > 1 else {}

    def log_files(self, local_rank: int) -> tuple[Path, Path]:
        """Where a rank other than local rank 0 (which keeps the terminal) writes stdout and stderr."""
        rank_dir = self.run_dir / f"rank{self.global_rank(local_rank)}"
        stdout = self._fill(self.stdout_template, local_rank) or rank_dir / "stdout.log"
        stderr = self._fill(self.stderr_template, local_rank) or rank_dir / "stderr.log"
        return stdout, stderr

    def _fill(self, template: str | None, local_rank: int) -> Path | None:
        if template is None:
            return None
        layout = self.layout
        return Path(
            template.format(
                rank=self.global_rank(local_rank),
                local_rank=local_rank,
                node_rank=layout.node_rank,
                world_size=layout.world_size,
                local_world_size=layout.processes,
                run_dir=self.run_dir,
            )
        )

    def check_log_files(self) -> None:
        """Refuse templates that would make two ranks write one file (their output would interleave), or that
        name the node rank while it is still open (it is decided when the nodes join, after the files open)."""
        for option, template in (("--stdout", self.stdout_template), ("--stderr", self.stderr_template)):
            if self.layout.node_rank is None and template is not None and "{node_rank}" in template:
                raise PlanError(
                    f"{option}={template!r} uses {{node_rank}}, which is decided when the nodes join (no --num-nodes "
                    "or --node-rank given): use {rank}, or pass --num-nodes and --node-rank."
                )
        for option, index in (("--stdout", 0), ("--stderr", 1)):
            seen: dict[Path, int] = {}
            for local_rank in range(1, self.processes):
                path = self.log_files(local_rank)[index]
                if path in seen:
                    raise PlanError(
                        f"{option} gives ranks {self.global_rank(seen[path])} and {self.global_rank(local_rank)} "
                        f"the same file {str(path)!r}: put {{rank}} or {{local_rank}} in it."
                    )
                seen[path] = local_rank

    def describe(self) -> str:
        """The ``--dry-run`` report."""
        layout = self.layout
        options = {**CLI_SETTINGS, "mesh": CLI_MESH, "replica group": FT_REPLICA_GROUP}
        settings = {name: self.fabric_settings.get(var, "(script decides)") for name, var in options.items()}
        lines = [
            f"command:       {shlex.join(self.command())}",
            *(f"{name + ':':<15}{value}" for name, value in settings.items()),
            f"world size:    {layout.world_size} ({layout.describe_nodes()}, global ranks "
            f"{layout.ranks[0]}..{layout.ranks[-1]}",
            f"main address:  {self.main_address}:{self.main_port}",
            f"run dir:       {self.run_dir}",
        ]
        for local_rank in range(self.processes):
            variables = " ".join(f"{k}={v}" for k, v in sorted(self.rank_environment(local_rank).items()))
            lines.append(f"local rank {local_rank}:  {variables}")
        for local_rank in range(1, self.processes):
            stdout, stderr = self.log_files(local_rank)
            lines.append(f"local rank {local_rank} logs: stdout {stdout}, stderr {stderr}")
        return "\n".join(lines)


@dataclass(frozen=True)
class GroupsPlan:
    """``--replica-groups=N`` without ``--replica-group``: every replica group of a fault-tolerant run started on this
    machine, each supervised as a job of its own (a group that dies does not stop the others), and torchft's
    lighthouse started for them unless ``--lighthouse`` names one."""

    #: The job's run dir: each group's is ``run_dir/groupI``, the lighthouse's log ``run_dir/lighthouse.log``.
    run_dir: Path
    #: One launch plan per group, in group order: its own rendezvous port, run dir and group variables.
    groups: tuple[LaunchPlan, ...]
    #: HOST:PORT the CLI starts the lighthouse on; None: the groups use the lighthouse given.
    lighthouse_bind: str | None
    #: How many times each group that failed is started again (``--max-restarts``).
    max_restarts: int = 0

    def describe(self) -> str:
        """The ``--dry-run`` report: the lighthouse, then each group's plan."""
        given = self.groups[0].fabric_settings[FT_LIGHTHOUSE]
        lines = [
            f"lighthouse:    {'started on ' + self.lighthouse_bind if self.lighthouse_bind else given}",
            f"max restarts:  {self.max_restarts} per group",
            f"run dir:       {self.run_dir}",
        ]
        for index, group in enumerate(self.groups):
            lines += [f"--- replica group {index} of {len(self.groups)}", group.describe()]
        return "\n".join(lines)


def local_groups(
    plan: LaunchPlan, replica_groups: int, lighthouse: str | None, strategy: str | None, max_restarts: int
) -> GroupsPlan:
    """``plan`` made one plan per replica group, every group on this node, each on a free rendezvous port."""
    if plan.layout.several_nodes:
        raise PlanError(
            f"--replica-groups={replica_groups} without --replica-group starts every group on this machine, but the "
            "job spans several nodes: start one job per group, each with its --replica-group and the same --lighthouse."
        )
    bind = None if lighthouse else f"127.0.0.1:{find_free_port()}"
    address = lighthouse or str(bind)
    replica_group_settings(replica_groups, 0, address, strategy)  # the count, the address and the strategy, once
    ports = [plan.main_port]
    while len(ports) < replica_groups:  # one rendezvous port per group, none the lighthouse's
        port = find_free_port()
        if port not in ports and f":{port}" not in address:
            ports.append(port)
    groups = tuple(
        dataclasses.replace(
            plan,
            main_port=ports[index],
            run_dir=plan.run_dir / f"group{index}",
            fabric_settings={
                **plan.fabric_settings,
                **replica_group_settings(replica_groups, index, address, strategy),
            },
        )
        for index in range(replica_groups)
    )
    return GroupsPlan(plan.run_dir, groups, bind, max_restarts)


def check_template(option: str, template: str | None) -> None:
    """A ``--stdout``/``--stderr`` template may use only :data:`TEMPLATE_FIELDS`."""
    if template is None:
        return
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as error:
        raise PlanError(f"{option}={template!r} is not a valid template: {error}.") from None
    for name in fields:
        if name not in TEMPLATE_FIELDS:
            accepted = ", ".join(f"{{{known}}}" for known in TEMPLATE_FIELDS)
            raise PlanError(f"{option}={template!r} uses {{{name}}}; accepted fields: {accepted}.")


def processes_per_node(accelerator: str, devices: str) -> int:
    """How many processes ``devices`` means on this node for ``accelerator``, checked against the machine."""
    try:
        request = parse_devices(devices)
    except ValueError as error:
        raise PlanError(str(error)) from None
    if accelerator == "cpu":
        if isinstance(request, tuple):
            raise PlanError(f"--devices={devices} lists device indices; on CPU pass a process count, e.g. --devices=2.")
        if request == AUTO:
            return 1
        count = (os.cpu_count() or 1) if request == ALL else request
        warning = cpu_oversubscription(count, os.cpu_count() or 1, "--devices")
        if warning is not None:  # said before the processes start, as Fabric(devices=...) says it
            print(f"fabric: warning: {warning}", file=sys.stderr, flush=True)
        return count
    if isinstance(request, int) and request >= 1 and accelerator == "auto":
        return request  # whichever accelerator the script finds, this many processes
    return _count_on_device(accelerator, devices)


def _count_on_device(accelerator: str, devices: str) -> int:
    """Ask the real accelerator (this imports torch) how many devices ``devices`` selects."""
    from fabric.connector import resolve

    try:
        resolved = resolve(accelerator=accelerator, devices=devices, strategy="ddp", environ={})
    except ValueError as error:
        raise PlanError(str(error)) from None
    return len(resolved.devices)


def check_node_options(num_nodes: int | None, node_rank: int | None, main_address: str | None) -> None:
    """The checks on ``--num-nodes``/``--node-rank``/``--main-address`` that need no device count."""
    if num_nodes is not None and node_rank is not None and not 0 <= node_rank < num_nodes:
        raise PlanError(f"--node-rank={node_rank} is outside [0, {num_nodes}) for --num-nodes={num_nodes}.")
    if (num_nodes or 1) > 1 and not main_address:
        raise PlanError(
            f"--num-nodes={num_nodes} needs --main-address: the host of node 0, which every node can reach."
        )
