"""Resolve ``Fabric(...)`` arguments into concrete accelerator, strategy and precision objects.

Resolution is three declarative steps:

1. **Pick** each setting: an explicit argument, else the CLI's environment variable (only in processes
   the CLI started), else the default. An explicit argument that disagrees with the CLI is an error; one
   that agrees is kept (a configured strategy object keeps its settings).
2. **Build**: ``"auto"`` becomes the first available accelerator and, from the number of processes,
   a strategy (in a notebook, one that forks); registries turn names into objects. In a process that a
   launcher started (torchrun, ``srun``, ``mpirun``, ...), ``devices`` and ``num_nodes`` not given follow
   the launcher's layout, and given ones must agree with it (:func:`follow_launcher`): no process
   silently runs as a world of its own.
   The CLI's ``--mesh`` goes to the strategy built (:meth:`~fabric.strategies.strategy.Strategy.configure_mesh`).
3. **Check** the combination against :data:`COMPATIBILITY_RULES`.

Nothing else in the package re-derives these choices: everything reads :class:`Resolved`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fabric.accelerators.accelerator import Accelerator
from fabric.accelerators.registry import (
    ACCELERATOR_REGISTRY,
    GPU_ACCELERATORS,
    SPECIAL_ACCELERATORS,
    accelerator_choices,
)
from fabric.plugins.environments import ClusterEnvironment, detect_environment
from fabric.plugins.environments.cluster_environment import LaunchedLayout
from fabric.plugins.io.checkpoint_io import CheckpointIO
from fabric.plugins.precision.dtypes import PRECISION_DTYPES
from fabric.plugins.precision.precision import Precision
from fabric.plugins.precision.registry import PRECISION_REGISTRY, parse_precision
from fabric.strategies.mesh import MeshPlan
from fabric.strategies.registry import STRATEGY_REGISTRY, strategy_choices
from fabric.strategies.single_device import SingleDeviceStrategy
from fabric.strategies.strategy import Strategy
from fabric.utilities.cli_contract import CLI_MARKER, CLI_MESH, CLI_SETTINGS
from fabric.utilities.device_parser import AUTO, DeviceRequest, DevicesArg, parse_devices
from fabric.utilities.rank_zero import rank_zero_warn
from fabric.utilities.registry import unknown_choice

AcceleratorArg = str | Accelerator
StrategyArg = str | Strategy
PrecisionArg = str | int | None
Plugin = Precision | CheckpointIO | ClusterEnvironment


def _parse_accelerator(value: AcceleratorArg) -> AcceleratorArg:
    if isinstance(value, Accelerator) or value in SPECIAL_ACCELERATORS:
        return value
    if not isinstance(value, str) or value not in ACCELERATOR_REGISTRY:
        raise unknown_choice("accelerator", value, accelerator_choices())
    return ACCELERATOR_REGISTRY.canonical_name(value)


def _parse_strategy(value: StrategyArg) -> StrategyArg:
    if isinstance(value, Strategy) or value == "auto":
        return value
    if not isinstance(value, str) or value not in STRATEGY_REGISTRY:
        raise unknown_choice("strategy", value, strategy_choices())
    return STRATEGY_REGISTRY.canonical_name(value)


def _parse_num_nodes(value: int | str) -> int:
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit() or int(text) < 1:
        raise ValueError(f"num_nodes={value!r} is not valid. Accepted: an int >= 1.")
    return int(text)


def _parse_optional_precision(value: PrecisionArg) -> str | None:
    return None if value is None else parse_precision(value)


@dataclass(frozen=True)
class Setting:
    """One ``Fabric`` argument: its "not given" default and the parser that normalises it."""

    name: str
    default: Any
    parse: Callable[[Any], Any]


#: Step 1's table. Defaults mean "not given": the CLI's value, then auto-detection, fill them in.
SETTINGS: tuple[Setting, ...] = (
    Setting("accelerator", "auto", _parse_accelerator),
    Setting("strategy", "auto", _parse_strategy),
    Setting("devices", "auto", parse_devices),
    Setting("num_nodes", 1, _parse_num_nodes),
    Setting("precision", None, _parse_optional_precision),
)


@dataclass(frozen=True)
class Resolved:
    """The outcome of resolution: what this process runs on and how."""

    accelerator: Accelerator
    strategy: Strategy
    precision: Precision
    devices: list[torch.device]
    num_nodes: int

    @property
    def num_processes(self) -> int:
        return len(self.devices) * self.num_nodes


#: Step 3's table: (is the combination broken?, why, in words naming the values).
COMPATIBILITY_RULES: tuple[tuple[Callable[[Resolved], bool], Callable[[Resolved], str]], ...] = (
    (
        lambda r: r.precision.name == "64-true" and not r.accelerator.supports_dtype(torch.float64),
        lambda r: (
            f"precision='64-true' needs float64, which {type(r.accelerator).__name__} does not support. Use '32-true'."
        ),
    ),
    (
        lambda r: (
            PRECISION_DTYPES.get(r.precision.name) is torch.bfloat16
            and not r.accelerator.supports_dtype(torch.bfloat16)
        ),
        lambda r: (
            f"precision={r.precision.name!r} needs bfloat16, which this {r.accelerator.device_type} device "
            "does not support. Use '16-mixed' or '32-true'."
        ),
    ),
    (
        lambda r: r.precision.device_error(r.accelerator.device_type) is not None,
        lambda r: str(r.precision.device_error(r.accelerator.device_type)),
    ),
    (
        lambda r: not r.precision.works_with_sharding and r.strategy.saves_on_every_rank,
        lambda r: (
            f"{type(r.precision).__name__} replaces whole layers in each process, which {type(r.strategy).__name__} "
            "shards over the ranks: use it on one device or with strategy='ddp'."
        ),
    ),
    (
        lambda r: r.strategy.configuration_error() is not None,
        lambda r: str(r.strategy.configuration_error()),
    ),
)


def pick_settings(given: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """Step 1: combine explicit arguments with the CLI's environment variables, parsed and checked."""
    from_cli = environ.get(CLI_MARKER) == "1"
    picked = {}
    for setting in SETTINGS:
        explicit = given[setting.name]
        value = setting.parse(explicit)
        env_var = CLI_SETTINGS[setting.name]
        if from_cli and env_var in environ:
            cli_value = setting.parse(environ[env_var])
            if explicit == setting.default:
                value = cli_value
            else:  # both given: they must agree, and the script's (a configured object) is kept
                difference = _disagreement(value, cli_value)
                if difference is not None:
                    raise ValueError(
                        f"Fabric({setting.name}={explicit!r}) conflicts with the CLI's "
                        f"--{setting.name.replace('_', '-')}={environ[env_var]} ({env_var}){difference}. "
                        "Remove one of the two."
                    )
        picked[setting.name] = value
    return picked


def cli_mesh(environ: Mapping[str, str]) -> MeshPlan | None:
    """The CLI's ``--mesh`` (only in processes the CLI started), parsed."""
    if environ.get(CLI_MARKER) != "1" or CLI_MESH not in environ:
        return None
    return MeshPlan.parse(environ[CLI_MESH])


def _disagreement(explicit: object, from_cli: object) -> str | None:
    """``None`` when the script's value is the CLI's choice, else what differs (``""``: all of it).

    A strategy object agrees with a name when it is of that name's class and has its fixed settings
    (``fsdp_cpu_offload``: ``cpu_offload=True``; ``ddp_spawn``: ``start_method="spawn"``).
    """
    if isinstance(explicit, Strategy) and isinstance(from_cli, str):
        entry = STRATEGY_REGISTRY.get(from_cli)
        if type(explicit) is not entry.resolve_target():
            return ""
        differing = [
            f"{name}={getattr(explicit, name, None)!r} where {from_cli!r} has {name}={fixed!r}"
            for name, fixed in entry.init_kwargs.items()
            if getattr(explicit, name, None) != fixed
        ]
        return f": the object has {', '.join(differing)}" if differing else None
    if isinstance(explicit, Accelerator) and isinstance(from_cli, str):
        named = ACCELERATOR_REGISTRY.get(from_cli).resolve_target() if from_cli in ACCELERATOR_REGISTRY else None
        return None if type(explicit) is named else ""
    return None if explicit == from_cli else ""


def _is_available(accelerator_name: str) -> bool:
    accelerator_class = ACCELERATOR_REGISTRY.get(accelerator_name).resolve_target()
    return (
        isinstance(accelerator_class, type)
        and issubclass(accelerator_class, Accelerator)
        and accelerator_class.is_available()
    )


def _build_accelerator(choice: AcceleratorArg) -> Accelerator:
    if isinstance(choice, Accelerator):
        return choice
    candidates = {"auto": ACCELERATOR_REGISTRY.names(), "gpu": list(GPU_ACCELERATORS)}.get(choice, [choice])
    for name in candidates:
        if _is_available(name):
            return ACCELERATOR_REGISTRY.create(name)
    available = [name for name in ACCELERATOR_REGISTRY if _is_available(name)]
    raise ValueError(f"accelerator={choice!r} is not available on this machine. Available: {available}.")


def _build_strategy(choice: StrategyArg, num_processes: int, launched: bool, interactive: bool) -> Strategy:
    if isinstance(choice, Strategy):
        return choice
    if choice == "auto":
        choice = _auto_strategy(num_processes, launched, interactive)
    return STRATEGY_REGISTRY.create(choice)


def _auto_strategy(num_processes: int, launched: bool, interactive: bool) -> str:
    """``strategy="auto"``: one process, or DDP; a notebook that starts its own processes forks them
    (re-running a script, ``ddp``'s way, cannot work without a script file), as Lightning does."""
    if num_processes == 1:
        return "single_device"
    if interactive and not launched:
        rank_zero_warn(
            f"Fabric(strategy='auto') with {num_processes} processes in an interactive session (a notebook, REPL or "
            "`python -c`): using strategy='ddp_notebook', which forks them from this process. Pass strategy= "
            "to choose another."
        )
        return "ddp_notebook"
    return "ddp"


def _runs_one_process(choice: StrategyArg) -> bool:
    return isinstance(choice, SingleDeviceStrategy) or choice == "single_device"


def _one_process_of_its_own(picked: Mapping[str, Any]) -> bool:
    """A Fabric of one device built in a process that already joined its launched world (through an earlier
    Fabric): one process of its own, outside that world, as in Lightning (litgpt merges LoRA weights on rank 0 so,
    after training). Any other request there still has to agree with the launcher."""
    one_device = picked["devices"] == 1 and picked["num_nodes"] == 1
    one_process = picked["strategy"] == "auto" or _runs_one_process(picked["strategy"])
    joined = torch.distributed.is_available() and torch.distributed.is_initialized()
    return one_device and one_process and joined


def _launcher_devices(layout: LaunchedLayout | None, devices: DeviceRequest, num_nodes: int) -> DeviceRequest:
    """``devices`` not given in a launched process: as many as the launcher started on this node."""
    if layout is None or devices != AUTO:
        return devices
    if layout.local_world_size is not None:
        return layout.local_world_size
    if layout.world_size % num_nodes == 0:
        return layout.world_size // num_nodes
    return devices


def follow_launcher(
    layout: LaunchedLayout | None, strategy: StrategyArg, given_devices: Any, num_devices: int, num_nodes: int
) -> int:
    """The node count of a launched job (``num_nodes`` not given follows the launcher), or a ``ValueError``
    naming both sides when the arguments disagree with what the launcher started.

    Checked on every rank when ``Fabric(...)`` is built, long before any rendezvous could hang or a rank
    index a device it does not have.
    """
    if layout is None:
        return num_nodes
    if _runs_one_process(strategy):
        if layout.world_size > 1:
            raise ValueError(
                f"{layout.describe()}, but strategy='single_device' runs one process: each of them would train "
                "alone on all the data. Leave strategy out (Fabric then joins the launcher's world with 'ddp'), "
                "or start one process."
            )
        return num_nodes
    if layout.num_nodes is not None and layout.local_world_size == num_devices:
        if num_nodes in (1, layout.num_nodes):  # nodes may differ in size: the launcher's count is the truth
            return layout.num_nodes
    elif layout.local_world_size is None:
        if num_nodes == 1 and layout.world_size % num_devices == 0:
            return layout.world_size // num_devices
        if num_devices * num_nodes == layout.world_size:
            return num_nodes
    elif layout.local_world_size == num_devices:
        nodes = -(-layout.world_size // num_devices)  # rounded up: launchers may put fewer on the last node
        if num_nodes in (1, nodes):
            return nodes
    raise ValueError(
        f"{layout.describe()}, but Fabric(devices={given_devices!r}, num_nodes={num_nodes}) means {num_devices} per "
        f"node x {num_nodes} node(s) = {num_devices * num_nodes}. Leave devices and num_nodes out to follow the "
        "launcher, or make them agree with it (devices = processes per node, num_nodes = nodes)."
    )


@dataclass(frozen=True)
class _Plugins:
    precision: Precision | None = None
    checkpoint_io: CheckpointIO | None = None
    cluster_environment: ClusterEnvironment | None = None


_PLUGIN_KINDS = {"precision": Precision, "checkpoint_io": CheckpointIO, "cluster_environment": ClusterEnvironment}


def _split_plugins(plugins: Sequence[Plugin] | Plugin | None) -> _Plugins:
    """Sort the ``plugins`` argument by kind; at most one of each."""
    found: dict[str, Any] = {}
    items: list[object] = list(plugins) if isinstance(plugins, (list, tuple)) else [] if plugins is None else [plugins]
    for plugin in items:
        kind = next((name for name, cls in _PLUGIN_KINDS.items() if isinstance(plugin, cls)), None)
        if kind is None or kind in found:
            raise ValueError(
                f"plugins: {plugin!r} is not accepted here (a second plugin of a kind, or an unknown kind). "
                "Accepted: one Precision, one CheckpointIO and one ClusterEnvironment."
            )
        found[kind] = plugin
    return _Plugins(**found)


def _cluster_environment(
    strategy: StrategyArg, plugin: ClusterEnvironment | None, environ: Mapping[str, str] | None
) -> ClusterEnvironment:
    """The strategy object's own environment, else the ``plugins`` one, else the launcher detected in ``environ``."""
    own = strategy.own_cluster_environment if isinstance(strategy, Strategy) else None
    return own or plugin or detect_environment(environ)


def resolve(
    accelerator: AcceleratorArg = "auto",
    strategy: StrategyArg = "auto",
    devices: DevicesArg = "auto",
    num_nodes: int = 1,
    precision: PrecisionArg = None,
    plugins: Sequence[Plugin] | Plugin | None = None,
    environ: Mapping[str, str] | None = None,
    interactive: bool = False,
) -> Resolved:
    """Run the three steps and wire the resulting objects together; ``interactive``: no script file to
    start again (a notebook), so several processes of ``strategy="auto"`` are forked."""
    picked = pick_settings(
        {
            "accelerator": accelerator,
            "strategy": strategy,
            "devices": devices,
            "num_nodes": num_nodes,
            "precision": precision,
        },
        os.environ if environ is None else environ,
    )
    given_plugins = _split_plugins(plugins)
    precision_plugin = given_plugins.precision
    if precision_plugin is not None and picked["precision"] is not None:
        raise ValueError(
            f"precision={picked['precision']!r} and plugins=[{precision_plugin!r}] both set the precision; pass one."
        )
    accelerator_obj = _build_accelerator(picked["accelerator"])
    environment = _cluster_environment(picked["strategy"], given_plugins.cluster_environment, environ)
    layout = None if _one_process_of_its_own(picked) else environment.launched_layout()
    device_request: DeviceRequest = picked["devices"]
    if not _runs_one_process(picked["strategy"]):
        device_request = _launcher_devices(layout, device_request, picked["num_nodes"])
    device_list = accelerator_obj.resolve_devices(device_request)
    num_nodes = follow_launcher(layout, picked["strategy"], picked["devices"], len(device_list), picked["num_nodes"])
    strategy_obj = _build_strategy(picked["strategy"], len(device_list) * num_nodes, layout is not None, interactive)
    mesh = cli_mesh(os.environ if environ is None else environ)
    if mesh is not None:
        strategy_obj.configure_mesh(mesh)
    if precision_plugin is None:  # not given: the strategy's own configuration's (a DeepSpeed config's), else 32-true
        precision_name = picked["precision"] or strategy_obj.default_precision() or "32-true"
        precision_plugin = PRECISION_REGISTRY.create(precision_name, device_type=accelerator_obj.device_type)
    strategy_obj.connect(
        accelerator=accelerator_obj,
        precision=precision_plugin,
        checkpoint_io=given_plugins.checkpoint_io,
        devices=device_list,
        num_nodes=num_nodes,
        cluster_environment=environment,
    )
    resolved = Resolved(
        accelerator=strategy_obj.accelerator,
        strategy=strategy_obj,
        precision=strategy_obj.precision,
        devices=device_list,
        num_nodes=num_nodes,
    )
    for is_broken, explain in COMPATIBILITY_RULES:
        if is_broken(resolved):
            raise ValueError(explain(resolved))
    return resolved
