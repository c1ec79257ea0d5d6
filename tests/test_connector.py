"""How Fabric(...) arguments, CLI variables and auto-detection resolve, and every bad value's error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from fabric import Fabric
from fabric.accelerators import CPUAccelerator
from fabric.connector import resolve
from fabric.plugins.io import TorchCheckpointIO
from fabric.plugins.precision import PRECISION_REGISTRY, MixedPrecision, Precision, parse_precision
from fabric.strategies import STRATEGY_REGISTRY, DDPStrategy, FSDPStrategy, SingleDeviceStrategy
from fabric.utilities.device_parser import parse_devices
from fabric.utilities.registry import Registry

CLI = {"FABRIC_CLI_LAUNCHED": "1"}


def test_defaults_resolve_to_single_cpu_process_in_float32() -> None:
    resolved = resolve(environ={})
    assert isinstance(resolved.accelerator, CPUAccelerator)
    assert isinstance(resolved.strategy, SingleDeviceStrategy)
    assert resolved.precision.name == "32-true"
    assert resolved.devices == [torch.device("cpu")]
    assert resolved.num_processes == 1


@pytest.mark.parametrize(
    ("spelling", "canonical"),
    [
        (32, "32-true"),
        ("32", "32-true"),
        ("fp32", "32-true"),
        (64, "64-true"),
        (16, "16-mixed"),
        ("16", "16-mixed"),
        ("amp_fp16", "16-mixed"),
        ("bf16", "bf16-mixed"),
        ("amp_bf16", "bf16-mixed"),
        ("fp8", "fp8-mixed"),
        ("amp_fp8", "fp8-mixed"),
        ("16-true", "16-true"),
        ("bf16-true", "bf16-true"),
    ],
)
def test_precision_spellings_map_to_one_canonical_name(spelling: str | int, canonical: str) -> None:
    assert parse_precision(spelling) == canonical
    assert resolve(precision=spelling, environ={}).precision.name == canonical


@pytest.mark.parametrize("bad", ["17", "fp4", 8, "bf32", True, 1.5])
def test_unknown_precision_lists_every_accepted_value(bad: object) -> None:
    with pytest.raises(ValueError, match="Unknown precision") as error:
        resolve(precision=bad, environ={})  # type: ignore[arg-type]
    for name in PRECISION_REGISTRY.choices():
        assert repr(name) in str(error.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"accelerator": "tpu"}, "Unknown accelerator 'tpu'. Accepted values: 'auto', 'gpu', 'cuda', 'mps', 'cpu'"),
        ({"strategy": "magic"}, "Unknown strategy 'magic'. Accepted values: 'auto', 'single_device', 'ddp'"),
        ({"devices": "two"}, "devices='two' is not valid. Accepted: an int >= 1"),
        ({"devices": 0}, "devices=0 is not valid"),
        ({"devices": -2}, "devices=-2 is not valid"),
        ({"devices": [0, 0]}, "distinct, non-negative"),
        ({"devices": [0, 1]}, "CPU processes all share one CPU device"),
        ({"num_nodes": 0}, "num_nodes=0 is not valid. Accepted: an int >= 1"),
        ({"accelerator": "cuda"}, "accelerator='cuda' is not available on this machine. Available: \\['cpu'\\]"),
        ({"strategy": "single_device", "devices": 2}, "strategy='single_device' runs one process"),
    ],
)
def test_bad_arguments_fail_at_construction_with_the_value_and_the_choices(kwargs: dict, message: str) -> None:
    if "cuda" in str(kwargs) and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=message):
        Fabric(**kwargs)


@pytest.mark.parametrize(
    ("devices", "parsed"),
    [
        (1, 1),
        (4, 4),
        (-1, -1),
        ("-1", -1),
        ("3", 3),
        ("auto", "auto"),
        ("0,1", (0, 1)),
        ("1,", (1,)),
        ([2, 0], (2, 0)),
        ((1,), (1,)),
    ],
)
def test_devices_forms(devices: object, parsed: object) -> None:
    assert parse_devices(devices) == parsed  # type: ignore[arg-type]


def test_cpu_devices_count_processes() -> None:
    cpu = CPUAccelerator()
    assert cpu.resolve_devices("auto") == [torch.device("cpu")]
    assert cpu.resolve_devices(3) == [torch.device("cpu")] * 3
    assert len(cpu.resolve_devices(-1)) == CPUAccelerator.device_count()


def test_cli_variables_are_obeyed_only_with_the_cli_marker() -> None:
    stale = {"FABRIC_PRECISION": "bf16-mixed", "FABRIC_STRATEGY": "magic"}
    assert resolve(environ=stale).precision.name == "32-true"
    assert resolve(environ={**CLI, "FABRIC_PRECISION": "bf16-mixed"}).precision.name == "bf16-mixed"


def test_cli_value_fills_in_an_argument_left_at_its_default() -> None:
    resolved = resolve(accelerator="auto", environ={**CLI, "FABRIC_ACCELERATOR": "cpu", "FABRIC_DEVICES": "1"})
    assert isinstance(resolved.accelerator, CPUAccelerator)


def test_explicit_argument_that_agrees_with_the_cli_is_fine() -> None:
    resolved = resolve(precision="bf16", environ={**CLI, "FABRIC_PRECISION": "bf16-mixed"})
    assert resolved.precision.name == "bf16-mixed"


def test_explicit_argument_that_disagrees_with_the_cli_names_both() -> None:
    with pytest.raises(ValueError) as error:
        resolve(precision="16-mixed", environ={**CLI, "FABRIC_PRECISION": "bf16-mixed"})
    message = str(error.value)
    assert "Fabric(precision='16-mixed')" in message
    assert "--precision=bf16-mixed" in message
    assert "FABRIC_PRECISION" in message


def test_bad_cli_variable_is_rejected_with_the_choices() -> None:
    with pytest.raises(ValueError, match="Unknown strategy 'magic'"):
        resolve(environ={**CLI, "FABRIC_STRATEGY": "magic"})


def test_plugins_and_strategy_objects_are_used_as_given() -> None:
    checkpoint_io = TorchCheckpointIO()
    precision = MixedPrecision("bf16-mixed")
    strategy = SingleDeviceStrategy()
    resolved = resolve(strategy=strategy, plugins=[precision, checkpoint_io], environ={})
    assert resolved.strategy is strategy
    assert resolved.precision is precision
    assert strategy.checkpoint_io is checkpoint_io


def test_precision_given_twice_is_an_error() -> None:
    with pytest.raises(ValueError, match="both set the precision"):
        resolve(precision="bf16-mixed", plugins=Precision(), environ={})


def test_unknown_plugin_is_an_error() -> None:
    with pytest.raises(ValueError, match="is not accepted here"):
        resolve(plugins=[object()], environ={})  # type: ignore[list-item]


def test_registry_accepts_user_registrations_and_rejects_silent_overrides() -> None:
    registry: Registry[Precision] = Registry("precision")
    registry.register("mine", Precision, aliases=("m",))
    assert isinstance(registry.create("m"), Precision)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("mine", Precision)
    registry.register("mine", MixedPrecision, override=True, precision="bf16-mixed")
    assert isinstance(registry.create("mine"), MixedPrecision)


def test_registry_entries_can_name_their_class_lazily() -> None:
    registry: Registry[Precision] = Registry("precision")
    registry.register("lazy", "fabric.plugins.precision.half:HalfPrecision", precision="16-true")
    assert registry.create("lazy").name == "16-true"


def test_user_registered_strategy_is_selectable_by_name() -> None:
    class MyStrategy(SingleDeviceStrategy):
        pass

    STRATEGY_REGISTRY.register("my_single", MyStrategy)
    try:
        assert type(Fabric(strategy="my_single").strategy) is MyStrategy
    finally:
        STRATEGY_REGISTRY.unregister("my_single")


# --- a launcher's world: followed when not given, refused when contradicted ---------------------------

TORCHRUN_2x2 = {"RANK": "3", "GROUP_RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip
SRUN_2 = {"SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
          "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODELIST": "node1", "SLURM_JOB_ID": "77",
          "SLURM_JOB_NAME": "t"}  # fmt: skip
MPIRUN_2 = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}  # fmt: skip


@pytest.mark.parametrize(
    ("environ", "devices", "num_nodes", "rank"),
    [(TORCHRUN_2x2, 2, 2, 3), (SRUN_2, 2, 1, 1), (MPIRUN_2, 2, 1, 1)],
    ids=["torchrun", "srun", "mpirun"],
)
def test_default_fabric_joins_the_world_its_launcher_started(
    environ: dict[str, str], devices: int, num_nodes: int, rank: int
) -> None:
    """A default Fabric() under `srun -n 2` (or torchrun, mpirun) used to run each task as a world of one,
    each training alone on all the data."""
    resolved = resolve(environ=environ)
    assert type(resolved.strategy).__name__ == "DDPStrategy"
    assert (len(resolved.devices), resolved.num_nodes) == (devices, num_nodes)
    assert (resolved.strategy.world_size, resolved.strategy.global_rank) == (devices * num_nodes, rank)


# The smaller node of uneven jobs (2 + 1 ranks): `fabric run` in Composer's form, and `srun -n 3 -N 2`.
CLI_UNEVEN = {"LOCAL_RANK": "0", "RANK": "2", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "1", "NODE_RANK": "1",
              "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
              "FABRIC_CLI_LAUNCHED": "1"}  # fmt: skip
SRUN_UNEVEN = {**SRUN_2, "SLURM_NTASKS": "3", "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
               "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_NODELIST": "node[1-2]"}  # fmt: skip


@pytest.mark.parametrize("environ", [CLI_UNEVEN, SRUN_UNEVEN], ids=["fabric-run", "srun"])
@pytest.mark.parametrize("num_nodes", [1, 2])
def test_the_smaller_node_of_an_uneven_job_follows_the_launchers_node_count(
    environ: dict[str, str], num_nodes: int
) -> None:
    """The node of one rank took the job for three nodes of one (world 3 / 1 process) and refused num_nodes=2."""
    resolved = resolve(num_nodes=num_nodes, environ=environ)
    assert (len(resolved.devices), resolved.num_nodes) == (1, 2)
    assert (resolved.strategy.world_size, resolved.strategy.global_rank) == (3, 2)
    with pytest.raises(ValueError, match=r"started 3 processes on 2 nodes, 1 on this node, but Fabric\(devices=2"):
        resolve(devices=2, environ=environ)
    with pytest.raises(ValueError, match=r"on 2 nodes, 1 on this node, but Fabric\(devices='auto', num_nodes=3\)"):
        resolve(num_nodes=3, environ=environ)


def test_arguments_that_agree_with_the_launcher_are_fine() -> None:
    resolved = resolve(devices=2, num_nodes=2, strategy="ddp", environ=TORCHRUN_2x2)
    assert resolved.num_processes == 4


@pytest.mark.parametrize(
    ("environ", "kwargs", "message"),
    [
        (SRUN_2, {"devices": 1},
         "SLURM's srun started 2 processes, 2 on this node, but Fabric(devices=1, num_nodes=1) means 1 per node x 1"),
        (TORCHRUN_2x2, {"devices": 4},
         "torchrun started 4 processes, 2 on this node, but Fabric(devices=4, num_nodes=1)"),
        (TORCHRUN_2x2, {"num_nodes": 4},
         "torchrun started 4 processes, 2 on this node, but Fabric(devices='auto', num_nodes=4)"),
        (MPIRUN_2, {"devices": 3}, "mpirun started 2 processes, 2 on this node, but Fabric(devices=3, num_nodes=1)"),
    ],
)  # fmt: skip
def test_arguments_that_contradict_the_launcher_fail_naming_both(
    environ: dict[str, str], kwargs: dict[str, int], message: str
) -> None:
    """`srun -n 2` with Fabric(devices=1) died on rank 1 with a bare IndexError (parallel_devices[local_rank])."""
    with pytest.raises(ValueError, match="Leave devices and num_nodes out") as error:
        resolve(**kwargs, environ=environ)  # type: ignore[arg-type]
    assert message in str(error.value)


@pytest.mark.parametrize("strategy", ["single_device", SingleDeviceStrategy()], ids=["name", "object"])
def test_a_single_process_strategy_in_a_launched_world_is_refused(strategy: object) -> None:
    with pytest.raises(ValueError, match=r"SLURM's srun started 2 processes.*strategy='single_device' runs one"):
        resolve(strategy=strategy, environ=SRUN_2)  # type: ignore[arg-type]
    one_task = {
        **SRUN_2,
        "SLURM_NTASKS": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_TASKS_PER_NODE": "1",
    }
    assert resolve(strategy=strategy, environ=one_task).num_processes == 1  # type: ignore[arg-type]


# --- a configured strategy object under `fabric run model --strategy=...` -------------------------------------


def test_a_strategy_object_that_agrees_with_the_clis_choice_is_kept_with_its_settings() -> None:
    configured = DDPStrategy(timeout=timedelta(seconds=7), stall_threshold=0)
    resolved = resolve(strategy=configured, environ={**CLI, "FABRIC_STRATEGY": "ddp", "FABRIC_DEVICES": "2"})
    assert resolved.strategy is configured and configured.timeout == timedelta(seconds=7)
    full = FSDPStrategy(state_dict_type="full")
    assert resolve(strategy=full, environ={**CLI, "FABRIC_STRATEGY": "fsdp"}).strategy is full
    offloading = FSDPStrategy(cpu_offload=True)
    with pytest.raises(ValueError, match=r"cpu_offload=True.*needs an accelerator"):  # kept, so its own check runs
        resolve(strategy=offloading, environ={**CLI, "FABRIC_STRATEGY": "fsdp_cpu_offload"})


@pytest.mark.parametrize(
    ("strategy", "cli", "differs"),
    [
        (lambda: FSDPStrategy(), "fsdp_cpu_offload", "cpu_offload=False where 'fsdp_cpu_offload' has cpu_offload=True"),
        (lambda: DDPStrategy(), "ddp_spawn", "start_method='popen' where 'ddp_spawn' has start_method='spawn'"),
        (lambda: DDPStrategy(), "fsdp", "FABRIC_STRATEGY). Remove one"),
    ],
)
def test_a_strategy_object_that_disagrees_with_the_clis_choice_names_what_differs(
    strategy: Any, cli: str, differs: str
) -> None:
    with pytest.raises(ValueError, match="conflicts with the CLI's --strategy=") as error:
        resolve(strategy=strategy(), environ={**CLI, "FABRIC_STRATEGY": cli})
    assert differs in str(error.value)


_CONFIGURED_STRATEGY = textwrap.dedent(
    """
    import json, sys
    from datetime import timedelta
    from pathlib import Path

    from fabric import Fabric
    from fabric.strategies import DDPStrategy

    fabric = Fabric(strategy=DDPStrategy(timeout=timedelta(seconds=123), stall_threshold=0))
    fabric.launch()
    strategy = fabric.strategy
    report = [fabric.world_size, strategy.timeout.total_seconds(), strategy.stall_threshold]
    Path(sys.argv[1], f"rank{fabric.global_rank}.json").write_text(json.dumps(report))
    """
)


def test_fabric_run_model_keeps_the_scripts_configured_strategy(tmp_path: Path) -> None:
    script = tmp_path / "configured.py"
    script.write_text(_CONFIGURED_STRATEGY)
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    command = [sys.executable, "-m", "fabric_cli", "run", "model", "--strategy=ddp", "--devices=2"]
    result = subprocess.run(
        [*command, "--accelerator=cpu", str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,  # the CLI's run directory (runs/...) goes there, not into the checkout
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert reports == [[2, 123.0, 0.0]] * 2  # before, the CLI's plain "ddp" replaced it with defaults
