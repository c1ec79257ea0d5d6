"""What ``fabric run model`` will start: the validated launch plan and each rank's environment.

Everything here is torch-free, so ``--help``, ``--dry-run`` and bad input answer instantly; torch is
imported only to count GPUs when the user asks for GPUs.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from fabric.utilities.cli_contract import CLI_MARKER, CLI_SETTINGS
from fabric.utilities.device_parser import ALL, AUTO, parse_devices

#: torchrun's default rendezvous port, used when several nodes must agree on one.
DEFAULT_MULTI_NODE_PORT = 29500


class PlanError(ValueError):
    """An option value that cannot work; the message names the value and what is accepted."""


@dataclass(frozen=True)
class LaunchPlan:
    """The processes this node starts and the variables each one gets."""

    script: str
    script_args: tuple[str, ...]
    module: bool
    processes: int
    num_nodes: int
    node_rank: int
    world_size: int
    base_rank: int
    main_address: str
    main_port: int
    run_dir: Path
    #: ``FABRIC_*`` variables for the options the user actually passed, and nothing else.
    fabric_settings: dict[str, str] = field(default_factory=dict)

    def command(self) -> list[str]:
        target = ["-m", self.script] if self.module else [self.script]
        return [sys.executable, *target, *self.script_args]

    def global_rank(self, local_rank: int) -> int:
        return self.base_rank + local_rank

    def rank_environment(self, local_rank: int) -> dict[str, str]:
        """The variables (on top of the inherited ones) that tell ``Fabric()`` where this rank sits."""
        variables = {
            CLI_MARKER: "1",
            **self.fabric_settings,
            "MASTER_ADDR": self.main_address,
            "MASTER_PORT": str(self.main_port),
            "NODE_RANK": str(self.node_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.processes),
            "LOCAL_RANK": str(local_rank),
            "RANK": str(self.global_rank(local_rank)),
        }
        if "OMP_NUM_THREADS" not in os.environ:  # share the cores instead of oversubscribing them
            variables["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.processes))
        return variables

    def log_files(self, local_rank: int) -> tuple[Path, Path]:
        """Where a rank other than local rank 0 (which keeps the terminal) writes stdout and stderr."""
        rank_dir = self.run_dir / f"rank{self.global_rank(local_rank)}"
        return rank_dir / "stdout.log", rank_dir / "stderr.log"

    def describe(self) -> str:
        """The ``--dry-run`` report."""
        settings = {
            name: self.fabric_settings.get(variable, "(script decides)") for name, variable in CLI_SETTINGS.items()
        }
        lines = [
            f"command:       {shlex.join(self.command())}",
            *(f"{name + ':':<15}{value}" for name, value in settings.items()),
            f"world size:    {self.world_size} ({self.num_nodes} node(s)); this node: rank {self.node_rank}, "
            f"global ranks {self.base_rank}..{self.base_rank + self.processes - 1}",
            f"main address:  {self.main_address}:{self.main_port}",
            f"run dir:       {self.run_dir}",
        ]
        for local_rank in range(self.processes):
            variables = " ".join(f"{k}={v}" for k, v in sorted(self.rank_environment(local_rank).items()))
            lines.append(f"local rank {local_rank}:  {variables}")
        return "\n".join(lines)


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
        return (os.cpu_count() or 1) if request == ALL else request
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


def check_node_options(num_nodes: int, node_rank: int, main_address: str | None) -> None:
    if not 0 <= node_rank < num_nodes:
        raise PlanError(f"--node-rank={node_rank} is outside [0, {num_nodes}) for --num-nodes={num_nodes}.")
    if num_nodes > 1 and not main_address:
        raise PlanError(
            f"--num-nodes={num_nodes} needs --main-address: the host of node 0, which every node can reach."
        )
