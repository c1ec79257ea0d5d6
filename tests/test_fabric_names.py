"""Names Lightning Fabric users type: ``fabric.accelerator``, ``seed_everything`` seeding workers,
``fabric.save(filter=...)``, ``model.device``, ``is_wrapped``, ``fabric consolidate --output_file``, every
strategy class from ``fabric.strategies``, and a ``CheckpointIO`` plugin honoured or refused."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from torch import nn
from torch.utils.data import DataLoader

from fabric import Fabric
from fabric.accelerators.cpu import CPUAccelerator
from fabric.plugins.io import TorchCheckpointIO
from fabric.strategies import FSDPStrategy, ModelParallelStrategy
from fabric.utilities import is_wrapped
from fabric.utilities.seed import SEED_WORKERS_ENV_VAR, worker_init_function
from fabric_cli.cli import cli

SCRIPTS = Path(__file__).parent / "scripts"


def test_accelerator_is_the_strategys() -> None:
    fabric = Fabric(accelerator="cpu")
    assert isinstance(fabric.accelerator, CPUAccelerator)
    assert fabric.accelerator is fabric.strategy.accelerator


def test_set_up_module_reports_where_its_parameters_are() -> None:
    fabric = Fabric(accelerator="cpu")
    assert fabric.setup(nn.Linear(2, 2)).device == torch.device("cpu")
    with torch.device("meta"):
        on_meta = nn.Linear(2, 2)
    assert fabric.setup(on_meta, move_to_device=False).device == torch.device("meta")
    assert fabric.setup(nn.ReLU()).device == fabric.device  # nothing to ask: the strategy's device


def test_is_wrapped_tells_set_up_objects_from_the_users_own() -> None:
    fabric = Fabric(accelerator="cpu")
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(list(range(4)))
    set_up_model, set_up_optimizer = fabric.setup(model, optimizer)
    set_up_loader = fabric.setup_dataloaders(loader)
    assert [is_wrapped(obj) for obj in (set_up_model, set_up_optimizer, set_up_loader)] == [True, True, True]
    assert [is_wrapped(obj) for obj in (model, optimizer, loader, 3)] == [False, False, False, False]
    assert is_wrapped(torch.compile(set_up_model)) and not is_wrapped(torch.compile(model))


# --- fabric.save(filter=...) ----------------------------------------------------------------------------


def _two_layers() -> tuple[Fabric, nn.Module, torch.optim.Optimizer]:
    fabric = Fabric(accelerator="cpu")
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    set_up_model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return fabric, set_up_model, optimizer


def test_save_filter_keeps_only_the_selected_items_and_loads_back_non_strictly(tmp_path: Path) -> None:
    fabric, model, optimizer = _two_layers()
    path = tmp_path / "adapter.pt"
    fabric.save(
        path, {"model": model, "optimizer": optimizer, "step": 3}, filter={"model": lambda name, _: name[0] == "1"}
    )
    saved = torch.load(path, weights_only=True)
    assert list(saved["model"]) == ["1.weight", "1.bias"]
    assert list(saved["optimizer"]) == ["state", "param_groups"] and saved["step"] == 3
    fresh = fabric.setup(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)))
    fabric.load(path, {"model": fresh}, strict=False)
    assert torch.equal(fresh.module[1].weight, model.module[1].weight)
    assert not torch.equal(fresh.module[0].weight, model.module[0].weight)


@pytest.mark.parametrize(
    ("filter", "error", "message"),
    [
        ({"nope": lambda name, value: True}, ValueError, r"filter names \['nope'\], which are not in the state"),
        ({"step": lambda name, value: True}, ValueError, r"state\['step'\] is not one \(type int\)"),
        ({"model": "1."}, TypeError, r"filter\['model'\] must be a \(name, value\) -> bool function, got '1.'"),
        ([lambda name, value: True], TypeError, "filter must be a dict of state keys"),
    ],
)
def test_a_bad_save_filter_is_refused_before_anything_is_written(
    tmp_path: Path, filter: object, error: type[Exception], message: str
) -> None:
    fabric, model, _ = _two_layers()
    with pytest.raises(error, match=message):
        fabric.save(tmp_path / "out.pt", {"model": model, "step": 3}, filter=filter)  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir())


def test_sharded_checkpoints_refuse_a_filter(tmp_path: Path) -> None:
    keep_all = {"model": lambda name, value: True}
    with pytest.raises(ValueError, match="FSDPStrategy\\(state_dict_type='full'\\)"):
        FSDPStrategy().save_checkpoint(tmp_path / "out", {"model": nn.Linear(1, 1)}, filter=keep_all)
    if importlib.util.find_spec("deepspeed") is not None:
        from fabric.strategies.deepspeed import DeepSpeedStrategy

        with pytest.raises(ValueError, match="DeepSpeed saves the engine's shards whole"):
            DeepSpeedStrategy().save_checkpoint(tmp_path / "out", {"model": nn.Linear(1, 1)}, filter=keep_all)
    assert not list(tmp_path.iterdir())


# --- seed_everything(): workers seeded by default ------------------------------------------------------------


def test_seeding_workers_gives_set_up_loaders_a_worker_init_function(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SEED_WORKERS_ENV_VAR, "0")  # restored after the test
    fabric = Fabric(accelerator="cpu")
    fabric.seed_everything(1, workers=False)
    assert fabric.setup_dataloaders(DataLoader(list(range(4)))).worker_init_fn is None
    fabric.seed_everything(1)  # Lightning Fabric's default: workers=True
    loader = fabric.setup_dataloaders(DataLoader(list(range(4))))
    assert isinstance(loader.worker_init_fn, functools.partial)
    assert loader.worker_init_fn.func is worker_init_function and loader.worker_init_fn.keywords == {"rank": 0}
    own = DataLoader(list(range(4)), worker_init_fn=print)
    assert fabric.setup_dataloaders(own).worker_init_fn is print  # the user's own is kept
    assert own.worker_init_fn is print and DataLoader(list(range(4))).worker_init_fn is None


def test_workers_of_two_ranks_draw_distinct_numbers_that_repeat_with_the_seed(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "worker_seeds.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    # Without workers=True, worker w of rank 0 and of rank 1 draw the same numbers (what the option fixes).
    assert ranks[0]["plain"] == ranks[1]["plain"]
    streams = [tuple(draws) for report in ranks for draws in report["workers"].values()]
    assert len(streams) == 4
    for generator in range(3):  # torch, random, NumPy: four different draws for 2 ranks x 2 workers
        assert len({stream[generator] for stream in streams}) == 4
    assert [report["workers"] for report in ranks] == [report["workers_again"] for report in ranks]


# --- fabric consolidate ------------------------------------------------------------------------------


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    directory = tmp_path / "run" / "step-3"
    dcp.save({"model": {"w": torch.arange(3.0)}, "step": 3}, checkpoint_id=directory)
    return directory


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("form", ["default", "--output_file", "--output-file", "positional"])
def test_consolidate_writes_where_asked_or_beside_the_directory(sharded: Path, form: str) -> None:
    output = sharded.parent / "out.pt"
    arguments = {"default": [], "positional": [str(output)]}.get(form, [form, str(output)])
    result = CliRunner().invoke(cli, ["consolidate", str(sharded), *arguments])
    assert result.exit_code == 0, result.output
    written = sharded.parent / "step-3.consolidated" if form == "default" else output
    assert f"wrote {written}" in result.output
    assert torch.equal(torch.load(written, weights_only=True)["model"]["w"], torch.arange(3.0))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_consolidate_refuses_two_different_outputs(sharded: Path) -> None:
    result = CliRunner().invoke(cli, ["consolidate", str(sharded), "a.pt", "--output_file", "b.pt"])
    assert result.exit_code == 2
    assert "Two outputs given: OUTPUT='a.pt' and --output_file='b.pt'" in result.output


# --- every strategy class from fabric.strategies ------------------------------------------------------------


def test_every_strategy_class_imports_from_fabric_strategies_without_its_engine() -> None:
    code = (
        "import sys; from fabric.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, "
        "ModelParallelStrategy, SingleDeviceStrategy; import fabric.strategies as s; "
        "assert FSDPStrategy.__module__ == 'fabric.strategies.fsdp.strategy'; "
        "assert DeepSpeedStrategy.__module__ == 'fabric.strategies.deepspeed.strategy'; "
        "assert set(s.__all__) >= {'DDPStrategy', 'DeepSpeedStrategy', 'FSDPStrategy'}; "
        "print('deepspeed' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "False"  # the class is importable; DeepSpeed itself loads on first use


# --- a CheckpointIO plugin is honoured or refused, never ignored ----------------------------------------------


class _UsersIO(TorchCheckpointIO):
    """A user's plugin (its class name is what the refusal names)."""


@pytest.mark.parametrize(
    ("strategy", "named"),
    [
        (lambda: FSDPStrategy(), "FSDPStrategy(state_dict_type='sharded')"),
        (lambda: ModelParallelStrategy(lambda model, mesh: model), "ModelParallelStrategy(state_dict_type='sharded')"),
    ],
)
def test_sharded_strategies_refuse_a_checkpoint_io_they_would_ignore(strategy: Any, named: str) -> None:
    with pytest.raises(ValueError, match="plugins=\\[_UsersIO") as error:
        Fabric(accelerator="cpu", devices=1, strategy=strategy(), plugins=[_UsersIO()])
    assert named in str(error.value) and "state_dict_type='full'" in str(error.value)
    with pytest.raises(ValueError, match="would be ignored"):
        Fabric(accelerator="cpu", devices=1, strategy=FSDPStrategy(checkpoint_io=_UsersIO()))


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is an optional extra")
def test_deepspeed_refuses_a_checkpoint_io() -> None:
    with pytest.raises(ValueError, match="DeepSpeedStrategy saves through the DeepSpeed engine's own checkpointing"):
        Fabric(accelerator="cpu", devices=1, strategy="deepspeed", plugins=[_UsersIO()])


_FULL_FSDP_SAVE = textwrap.dedent(
    """
    import sys

    import torch

    from fabric import Fabric
    from fabric.plugins.io import TorchCheckpointIO
    from fabric.strategies import FSDPStrategy


    class Marking(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            checkpoint["written_by"] = "Marking"
            super().save_checkpoint(checkpoint, path, storage_options)


    fabric = Fabric(accelerator="cpu", devices=1, strategy=FSDPStrategy(state_dict_type="full"), plugins=[Marking()])
    fabric.launch()
    model = fabric.setup(torch.nn.Linear(2, 2))
    fabric.save(sys.argv[1], {"model": model})
    print(torch.load(sys.argv[1], weights_only=True)["written_by"])
    """
)


def test_fsdp_full_checkpoints_go_through_the_checkpoint_io(tmp_path: Path) -> None:
    script = tmp_path / "full_save.py"
    script.write_text(_FULL_FSDP_SAVE)
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "model.pt")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "Marking"


def test_setup_returns_a_scheduler_given_with_its_optimizer_as_it_is() -> None:
    fabric = Fabric(accelerator="cpu")
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, returned = fabric.setup(model, optimizer, scheduler=scheduler)
    assert returned is scheduler
    fabric.backward(model(torch.ones(1, 2)).sum())
    optimizer.step()
    scheduler.step()  # outside DeepSpeed the loop steps it, as before
    assert optimizer.param_groups[0]["lr"] == 0.5
