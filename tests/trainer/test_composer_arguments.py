"""Issue 28 item 3: Composer's Trainer arguments are accepted with Composer's meaning or refused by name with what
to use instead (a ``ValueError`` when the Trainer is built), never a bare ``TypeError``."""

from __future__ import annotations

import copy
import inspect
import io
import itertools
import logging
import os
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric
from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.events import Event
from fabric.trainer.core.passes import sort_to_front
from fabric.trainer.core.state import State
from fabric.trainer.loggers.console import ConsoleLogger
from fabric.trainer.migration import APPLIED, REFUSED, apply_dist_timeout, translate_fabric_choices
from fabric.trainer.surgery import SurgeryAlgorithm, replace_modules
from fabric.trainer.trainer import Trainer
from fabric.utilities.exceptions import CheckpointError

Batch = tuple[torch.Tensor, torch.Tensor]
DOCS = Path(__file__).parents[2] / "docs"


class Regressor(nn.Module):
    def __init__(self, extra_layer: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        if extra_layer:
            self.head = nn.Linear(1, 1)

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.net(batch[0])  # type: ignore[no-any-return]

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        return F.mse_loss(outputs.squeeze(-1), batch[1])


class WithMetric(Regressor):
    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        import torchmetrics

        return {"mse": torchmetrics.MeanSquaredError()}

    def update_metric(self, batch: Batch, outputs: torch.Tensor, metric: Any) -> None:
        metric.update(outputs.squeeze(-1), batch[1])


def _loader(samples: int = 24, batch_size: int = 4, shuffle: bool = True, seed: int = 0) -> DataLoader[Any]:
    x = torch.randn(samples, 4, generator=torch.Generator().manual_seed(seed))
    generator = torch.Generator().manual_seed(seed + 100)
    return DataLoader(TensorDataset(x, x.sum(1).sin()), batch_size=batch_size, shuffle=shuffle, generator=generator)


def _trainer(model: nn.Module | None = None, **options: Any) -> Trainer:
    model = model if model is not None else Regressor()
    settings: dict[str, Any] = {
        "train_dataloader": _loader(),
        "optimizers": torch.optim.SGD(model.parameters(), lr=0.1),
        "progress_bar": False,
        "seed": 0,
        "accelerator": "cpu",
    }
    settings.update(options)
    return Trainer(model=model, **settings)


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


# --- never a bare TypeError ------------------------------------------------------------------------------------

#: Every Composer argument of the issue, with Composer's default (or a plain value): all construct.
COMPOSER_DEFAULTS: dict[str, Any] = {
    "train_subset_num_batches": -1,
    "eval_subset_num_batches": -1,
    "spin_dataloaders": True,
    "dist_timeout": 300.0,
    "deterministic_mode": False,
    "compile_config": None,
    "log_to_console": False,
    "console_log_interval": "1ba",
    "console_stream": "stderr",
    "save_ignore_keys": None,
    "save_metrics": False,
    "load_ignore_keys": None,
    "load_weights_only": False,
    "load_strict_model_weights": False,
    "load_exclude_algorithms": [],
    "algorithm_passes": None,
    "parallelism_config": None,
    "fsdp_config": None,
    "python_log_level": None,
    "precision_config": None,
    "ddp_sync_strategy": None,
    "load_object_store": None,
    "accumulate_train_batch_on_tokens": False,
    "auto_log_hparams": False,
    "log_traces": False,
    "train_dataloader_label": "train",
    "load_progress_bar": True,
}

#: Composer's ``Trainer.__init__`` and ``Trainer.fit`` parameters, in its order (composer/trainer/trainer.py).
COMPOSER_INIT = [
    "model",
    "train_dataloader",
    "train_dataloader_label",
    "train_subset_num_batches",
    "spin_dataloaders",
    "max_duration",
    "algorithms",
    "algorithm_passes",
    "optimizers",
    "schedulers",
    "scale_schedule_ratio",
    "step_schedulers_every_batch",
    "eval_dataloader",
    "eval_interval",
    "eval_subset_num_batches",
    "callbacks",
    "loggers",
    "run_name",
    "progress_bar",
    "log_to_console",
    "console_stream",
    "console_log_interval",
    "log_traces",
    "auto_log_hparams",
    "load_path",
    "load_object_store",
    "load_weights_only",
    "load_strict_model_weights",
    "load_progress_bar",
    "load_ignore_keys",
    "load_exclude_algorithms",
    "save_folder",
    "save_filename",
    "save_latest_filename",
    "save_overwrite",
    "save_interval",
    "save_weights_only",
    "save_ignore_keys",
    "save_num_checkpoints_to_keep",
    "save_metrics",
    "autoresume",
    "parallelism_config",
    "device",
    "precision",
    "precision_config",
    "device_train_microbatch_size",
    "accumulate_train_batch_on_tokens",
    "seed",
    "deterministic_mode",
    "dist_timeout",
    "ddp_sync_strategy",
    "profiler",
    "python_log_level",
    "compile_config",
]
COMPOSER_FIT = [
    "train_dataloader",
    "train_dataloader_label",
    "train_subset_num_batches",
    "spin_dataloaders",
    "duration",
    "reset_time",
    "schedulers",
    "scale_schedule_ratio",
    "step_schedulers_every_batch",
    "eval_dataloader",
    "eval_subset_num_batches",
    "eval_interval",
    "device_train_microbatch_size",
    "precision",
]


def test_every_composer_trainer_and_fit_parameter_has_a_place_here() -> None:
    """Each is a parameter of ours, a Fabric choice (``precision``), or one :data:`APPLIED` or :data:`REFUSED` names."""
    taken = set(inspect.signature(Trainer.__init__).parameters) | set(APPLIED) | set(REFUSED) | {"precision"}
    assert [name for name in COMPOSER_INIT if name not in taken] == []
    assert [name for name in COMPOSER_FIT if name not in inspect.signature(Trainer.fit).parameters] == []


def test_the_migration_table_names_every_composer_trainer_and_fit_parameter() -> None:
    table = [line for line in (DOCS / "coming-from-composer.md").read_text().splitlines() if line.startswith("|")]
    fit_row = next(row for row in table if row.startswith("| `fit(...)`"))
    assert [name for name in COMPOSER_INIT if not any(f"`{name}`" in row for row in table)] == []
    assert [name for name in COMPOSER_FIT if f"`{name}`" not in fit_row] == []


def test_fit_refuses_another_train_dataloader_label_naming_it() -> None:
    trainer = _trainer()
    with pytest.raises(ValueError, match=r"train_dataloader_label='finetune'\) is not supported: the train"):
        trainer.fit(train_dataloader_label="finetune", duration="1ba")
    assert int(trainer.state.timestamp.batch) == 0


@pytest.mark.parametrize(("name", "value"), COMPOSER_DEFAULTS.items())
def test_every_composer_argument_is_taken_with_its_default(name: str, value: Any) -> None:
    _trainer(**{name: value}).fit(duration="1ba")


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("train_subset_num_batches", 0, r"train_subset_num_batches=0 is not valid\. Accepted: -1"),
        ("eval_subset_num_batches", "all", r"eval_subset_num_batches='all' is not valid"),
        ("spin_dataloaders", "yes", r"spin_dataloaders='yes' is not valid\. Accepted: True or False"),
        ("dist_timeout", -5, r"dist_timeout=-5 is not valid\. Accepted: a positive number of seconds"),
        ("deterministic_mode", 1, r"deterministic_mode=1 is not valid"),
        ("compile_config", True, r"compile_config=True is not valid\. Accepted: None, or a dict"),
        ("log_to_console", "yes", r"log_to_console='yes' is not valid"),
        ("console_log_interval", "10xx", r"console_log_interval='10xx'"),
        ("console_stream", "stdlog", r"console_stream='stdlog' is not valid\. Accepted: 'stdout', 'stderr'"),
        ("save_ignore_keys", "rng", r"save_ignore_keys='rng' is not valid\. Accepted: a list of Composer paths"),
        ("save_ignore_keys", ["state/optimizers/Adam/state"], r"reaches inside 'state/optimizers'.*saved and"),
        ("save_ignore_keys", ["state/scaler"], r"'state/scaler' is not supported: the loss scale"),
        ("save_metrics", "yes", r"save_metrics='yes' is not valid"),
        ("load_ignore_keys", ["state/model/net.0.weight"], r"would skip single weights of the model"),
        ("load_ignore_keys", ["state/nothing"], r"\['state/nothing'\], which name no part of a checkpoint"),
        ("load_strict_model_weights", "no", r"load_strict_model_weights='no' is not valid"),
        ("load_exclude_algorithms", "BlurPool", r"load_exclude_algorithms='BlurPool' is not valid\. Accepted: a list"),
        ("algorithm_passes", [42], r"algorithm_passes has 42\. Accepted: a function"),
        (
            "parallelism_config",
            {"tp": {}},
            r"\['tp'\]\['layer_plan'\]=None is not valid: tensor parallelism needs a plan",
        ),
        ("fsdp_config", {}, r"fsdp_config=\{\}\) is not supported: it is Composer's older name: pass parallelism"),
        ("fsdp_auto_wrap", True, r"fsdp_auto_wrap=True\) is not supported"),
        ("python_log_level", "loud", r"python_log_level='loud'\) is not a logging level: use one of \['critical'"),
        ("load_object_store", object(), r"load_object_store=.*pass an fsspec URL as load_path"),
        ("train_dataloader_label", "pretrain", r"train_dataloader_label='pretrain'\) is not supported"),
    ],
)
def test_a_refused_value_fails_at_construction_naming_it_and_what_to_use(name: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _trainer(**{name: value})


def test_python_log_level_sets_the_level_and_prints_records_with_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Composer's ``python_log_level``: the ``composer`` (and ``fabric``) loggers take the level, and records print
    with the process's rank (llm-foundry passes ``python_log_level='debug'``)."""
    root, composer = logging.getLogger(), logging.getLogger("composer")
    monkeypatch.setattr(root, "handlers", [])  # basicConfig acts only on a root logger without handlers
    monkeypatch.setattr(composer, "level", logging.NOTSET)
    monkeypatch.setattr(logging.getLogger("fabric"), "level", logging.NOTSET)
    monkeypatch.setenv("RANK", "0")
    _trainer(python_log_level="debug")
    assert composer.level == logging.DEBUG and logging.getLogger("fabric").level == logging.DEBUG
    assert "rank0[" in root.handlers[0].formatter._fmt  # type: ignore[union-attr]


# --- data: subsets and spinning --------------------------------------------------------------------------------


def test_train_subset_num_batches_ends_each_epoch_after_that_many_batches_like_islice() -> None:
    model = Regressor()
    reference = copy.deepcopy(model)
    trainer = _trainer(model, train_subset_num_batches=2, max_duration="3ep")
    assert trainer.state.dataloader_len == 2
    trainer.fit()
    stamp = trainer.state.timestamp
    assert (int(stamp.epoch), int(stamp.batch), int(stamp.sample)) == (3, 6, 24)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    loader = _loader()
    for _ in range(3):
        for x, y in itertools.islice(loader, 2):
            F.mse_loss(reference.net(x).squeeze(-1), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert _same(model, reference)
    assert _trainer(train_subset_num_batches=100).state.dataloader_len == 6  # more than the loader has: all


def test_spin_dataloaders_true_resumes_mid_epoch_at_the_first_unseen_batch(tmp_path: Path) -> None:
    straight = _trainer(spin_dataloaders=True, max_duration="2ep")
    straight.fit()
    first = _trainer(spin_dataloaders=True, max_duration="2ep")
    first.fit(duration="9ba")  # mid-epoch 1
    first.save_checkpoint(str(tmp_path / "mid.pt"))
    resumed = _trainer(spin_dataloaders=True, max_duration="2ep", load_path=str(tmp_path / "mid.pt"))
    resumed.fit()
    assert int(resumed.state.timestamp.batch) == 12 and _same(resumed.state.model, straight.state.model)


def test_spin_dataloaders_false_is_for_loaders_that_resume_themselves() -> None:
    class ResumesItself(DataLoader[Any]):
        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    x = torch.randn(8, 4)
    _trainer(train_dataloader=ResumesItself(TensorDataset(x, x.sum(1)), batch_size=4), spin_dataloaders=False)
    with pytest.raises(ValueError, match=r"spin_dataloaders=False is Composer's setting.*this DataLoader does not"):
        _trainer(spin_dataloaders=False)
    trainer = _trainer(train_dataloader=None, spin_dataloaders=False)  # checked again when fit() gets a loader
    with pytest.raises(ValueError, match="spin_dataloaders=False"):
        trainer.fit(train_dataloader=_loader(), duration="1ba")


# --- processes and kernels -------------------------------------------------------------------------------------


def test_dist_timeout_becomes_the_strategy_timeout_before_the_launch() -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")  # not launched: the timeout is read at launch
    apply_dist_timeout(fabric, 42.5)
    assert fabric.strategy.timeout == timedelta(seconds=42.5)  # type: ignore[attr-defined]
    single = _trainer(dist_timeout=10)  # one process: nothing to wait for, nothing to set
    assert single.fabric.world_size == 1
    with pytest.raises(ValueError, match="Pass either fabric= or dist_timeout="):
        Trainer(Regressor(), fabric=Fabric(accelerator="cpu"), dist_timeout=10)


def test_deterministic_mode_turns_on_deterministic_algorithms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic)
    try:
        with pytest.warns(UserWarning, match="Deterministic mode is activated"):
            _trainer(deterministic_mode=True).fit(duration="2ba")
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert not torch.backends.cudnn.benchmark and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic = before[1]


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compile_config_compiles_the_model_through_fabric_setup_and_trains_the_same() -> None:
    plain = _trainer(max_duration="1ep")
    plain.fit()
    compiled = _trainer(compile_config={"backend": "eager"}, max_duration="1ep")
    assert type(compiled.state.model._forward_module).__name__ == "OptimizedModule"
    assert type(plain.state.model._forward_module).__name__ == "Regressor"
    compiled.fit()
    assert _same(compiled.state.model, plain.state.model)
    defaults = _trainer(compile_config={}, max_duration="1ep")  # {}: torch.compile's defaults (inductor)
    assert type(defaults.state.model._forward_module).__name__ == "OptimizedModule"
    defaults.fit()
    for ours, theirs in zip(defaults.state.model.parameters(), plain.state.model.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs)
    with pytest.raises(ValueError, match=r"compile_config= was given with a model torch\.compile already compiled"):
        _trainer(torch.compile(Regressor()), compile_config={})


# --- console -----------------------------------------------------------------------------------------------------


def test_log_to_console_prints_the_metrics_every_console_log_interval() -> None:
    stream = io.StringIO()
    trainer = _trainer(log_to_console=True, console_log_interval="2ba", console_stream=stream, max_duration="4ba")
    trainer.fit()
    lines = stream.getvalue().splitlines()
    assert [line.split(" train:")[0] for line in lines] == ["[epoch=0 batch=2]", "[epoch=0 batch=4]"]
    assert all("loss/train/total" in line for line in lines)
    with pytest.warns(UserWarning, match="both progress_bar and log_to_console"):
        _trainer(log_to_console=True, progress_bar=True)
    own = ConsoleLogger(stream=io.StringIO())
    trainer = _trainer(log_to_console=True, loggers=[own])  # a console logger among the loggers: no second one
    assert [type(d) for d in trainer.logger.destinations].count(ConsoleLogger) == 1


def test_console_stream_stdout_prints_to_standard_output(capsys: pytest.CaptureFixture[str]) -> None:
    _trainer(log_to_console=True, console_stream="stdout", max_duration="1ba").fit()
    assert "[epoch=0 batch=1] train: loss/train/total" in capsys.readouterr().out


# --- checkpoints: ignored keys, metrics, strictness, excluded algorithms ------------------------------------------


def test_save_ignore_keys_leave_those_parts_out_and_the_checkpoint_still_loads(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt.pt")
    trainer = _trainer(save_ignore_keys=["state/optimizers", "rng", "state/model/net.2.*", "state/timestamp"])
    trainer.fit(duration="3ba")
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    assert sorted(saved) == ["meta", "model", "trainer"]
    assert sorted(saved["model"]) == ["net.0.bias", "net.0.weight"]
    assert "timestamp" not in saved["trainer"] and "schedulers" in saved["trainer"]
    assert saved["meta"]["ignored"] == [
        "eval_metrics",
        "metric_values",
        "optimizers",
        "rng",
        "timestamp",
        "train_metrics",
    ]

    fresh = _trainer(load_path=path, load_strict_model_weights=False)  # the model entry lacks net.2
    model = fresh.state.model.module
    assert torch.equal(model.net[0].weight, trainer.state.model.module.net[0].weight)
    assert torch.equal(model.net[2].weight, Regressor().net[2].weight)  # not in the checkpoint: unchanged
    assert int(fresh.state.timestamp.batch) == 0 and not fresh.state.optimizers[0].state  # left out: as they were
    with pytest.raises(CheckpointError, match=r"net\.2"):
        _trainer(load_path=path)  # strict about the model's weights by default

    whole = _trainer(save_ignore_keys=["state/model/*"])
    whole.save_checkpoint(path)
    assert "model" not in torch.load(path, weights_only=True)


def test_model_keys_are_refused_where_the_checkpoints_are_sharded_and_model_or_optimizers_under_deepspeed() -> None:
    from types import SimpleNamespace

    from fabric.trainer.checkpoint.parts import SelectiveCheckpointer

    def checkpointer(ignore: list[str], sharded: bool = False, deepspeed: bool = False) -> SelectiveCheckpointer:
        strategy = SimpleNamespace(saves_on_every_rank=sharded or deepspeed, engine_handles_gradients=deepspeed)
        state: Any = SimpleNamespace(fabric=SimpleNamespace(strategy=strategy), model=Regressor(), algorithms=[])
        return SelectiveCheckpointer(state, None, "run", save_ignore_keys=ignore)  # type: ignore[arg-type]

    checkpointer(["state/model/net.0.*"])
    checkpointer(["state/model/*", "state/optimizers"], sharded=True)  # whole entries: any strategy leaves them out
    with pytest.raises(ValueError, match=r"leaves single weights out.*FSDPStrategy\(state_dict_type='full'\)"):
        checkpointer(["state/model/net.0.*"], sharded=True)
    with pytest.raises(ValueError, match="DeepSpeed saves them together in its engine's checkpoint"):
        checkpointer(["state/optimizers"], deepspeed=True)
    checkpointer(["rng"], deepspeed=True)


def test_save_metrics_stores_the_metric_states_and_latest_values(tmp_path: Path) -> None:
    pytest.importorskip("torchmetrics")
    path = str(tmp_path / "ckpt.pt")
    trainer = _trainer(WithMetric(), save_metrics=True, eval_dataloader=_loader(8, shuffle=False))
    trainer.fit(duration="2ba")
    trainer.eval()
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    assert sorted(saved["metrics"]) == ["eval_metrics", "metric_values", "train_metrics"]
    fresh = _trainer(WithMetric(), eval_dataloader=_loader(8, shuffle=False), load_path=path)
    assert fresh.state.metrics["metrics/eval/mse"] == pytest.approx(trainer.state.metrics["metrics/eval/mse"])
    assert fresh.state.metrics["metrics/train/mse"] == pytest.approx(trainer.state.metrics["metrics/train/mse"])
    _trainer(WithMetric()).save_checkpoint(path)
    assert "metrics" not in torch.load(path, weights_only=True)  # save_metrics=False, Composer's default


def test_load_ignore_keys_take_composer_paths(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt.pt")
    trainer = _trainer()
    trainer.fit(duration="3ba")
    trainer.save_checkpoint(path)
    fresh = _trainer(load_path=path, load_ignore_keys=["state/optimizers", "rng", "state/timestamp"])
    assert int(fresh.state.timestamp.batch) == 0 and not fresh.state.optimizers[0].state
    assert _same(fresh.state.model, trainer.state.model)
    resumed = _trainer(load_path=path, load_ignore_keys=["optimizers"])  # the part names work as before
    assert int(resumed.state.timestamp.batch) == 3


def test_load_strict_model_weights_is_composers_name_for_load_strict(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt.pt")
    _trainer().save_checkpoint(path)
    skip = ["state/optimizers"]  # the optimizer of the larger model has more parameters
    with pytest.raises(CheckpointError, match="head"):
        _trainer(Regressor(extra_layer=True), load_path=path, load_strict_model_weights=True, load_ignore_keys=skip)
    loaded = _trainer(
        Regressor(extra_layer=True), load_path=path, load_strict_model_weights=False, load_ignore_keys=skip
    )
    assert torch.equal(loaded.state.model.module.net[0].weight, Regressor().net[0].weight)
    with pytest.raises(ValueError, match="load_strict=False and load_strict_model_weights=True disagree"):
        _trainer(load_strict=False, load_strict_model_weights=True)


class WrapFirstLinear(SurgeryAlgorithm):
    """Puts ``net.0`` inside a Sequential: its keys become ``net.0.0.*``."""

    def apply_surgery(self, model: nn.Module, optimizers: Sequence[Optimizer] = ()) -> None:
        replace_modules(model, {nn.Linear: lambda module, name: nn.Sequential(module) if name == "net.0" else None})

    def hparams(self) -> dict[str, Any]:
        return {}


def test_load_exclude_algorithms_skips_that_algorithms_recorded_surgery(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt.pt")
    trainer = _trainer(algorithms=[WrapFirstLinear()])
    trainer.fit(duration="2ba")
    trainer.save_checkpoint(path)
    replayed = _trainer(load_path=path)  # the surgery is re-applied, so the weights fit
    assert _same(replayed.state.model, trainer.state.model)
    with pytest.raises(CheckpointError, match=r"net\.0\.0\.weight"):
        _trainer(load_path=path, load_exclude_algorithms=["WrapFirstLinear"])
    plain = _trainer(load_path=path, load_exclude_algorithms=["WrapFirstLinear"], load_strict_model_weights=False)
    assert isinstance(plain.state.model.module.net[0], nn.Linear)  # no surgery: net.2 loaded, net.0 as built
    assert torch.equal(plain.state.model.module.net[2].weight, trainer.state.model.module.net[2].weight)


class Named(Algorithm):
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def match(self, event: Event, state: State) -> bool:
        return event == Event.FIT_START

    def apply(self, event: Event, state: State, logger: Any) -> None:
        self.log.append(self.name)


class First(Named):
    pass


def test_algorithm_passes_are_added_to_the_default_passes() -> None:
    log: list[str] = []

    def reverse(algorithms: Sequence[Algorithm], event: Event) -> list[Algorithm]:
        return list(reversed(algorithms))

    algorithms = [Named("a", log), First("b", log), Named("c", log)]
    _trainer(algorithms=algorithms).fit(duration="1ba")
    _trainer(algorithms=algorithms, algorithm_passes=reverse).fit(duration="1ba")
    _trainer(algorithms=algorithms, algorithm_passes=[(sort_to_front(First), 0), reverse]).fit(duration="1ba")
    assert log == ["a", "b", "c", "c", "b", "a", "c", "a", "b"]


# --- parallelism_config ------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(4, 1)

    def fsdp_wrap_fn(self, module: nn.Module) -> bool:
        return isinstance(module, Block)

    def activation_checkpointing_fn(self, module: nn.Module) -> bool:
        return isinstance(module, Block)


def _fsdp(config: dict[str, Any], model: nn.Module | None = None) -> Any:
    return translate_fabric_choices({}, None, None, {"fsdp": config}, model or Stack())["strategy"]


def test_parallelism_config_fsdp_maps_composers_keys_onto_fsdp_strategy() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = Stack()
    strategy = _fsdp(
        {
            "sharding_strategy": "SHARD_GRAD_OP",
            "activation_checkpointing": True,
            "activation_checkpointing_reentrant": True,
            "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
            "sync_module_states": True,
            "use_orig_params": True,
            "limit_all_gathers": True,
            "backward_prefetch": "BACKWARD_PRE",
            "forward_prefetch": False,
        },
        model,
    )
    assert type(strategy).__name__ == "FSDPStrategy"
    assert strategy.reshard_after_forward is False and not strategy.hybrid_shard and not strategy.replicate_only
    assert strategy.state_dict_type == "full"  # Composer's default
    assert strategy.activation_checkpointing == {Block}
    assert strategy.mixed_precision == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert strategy.sync_module_states is True
    units = [module for module in model.modules() if strategy.shard_modules(module)]
    assert units == list(model.blocks)  # auto_wrap (Composer's default) follows fsdp_wrap_fn
    assert _fsdp({"auto_wrap": False}).shard_modules is None
    assert _fsdp({"sharding_strategy": "NO_SHARD", "state_dict_type": "sharded"}).replicate_only is True
    assert _fsdp({"sharding_strategy": "hybrid_shard"}).hybrid_shard is True
    assert _fsdp({"reshard_after_forward": False}).reshard_after_forward is False
    assert _fsdp({"cpu_offload": True}).cpu_offload is True
    assert _fsdp({"mixed_precision": "FULL"}).mixed_precision == MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=torch.float32
    )
    plain = nn.Sequential(nn.Linear(2, 2))
    plain[0]._fsdp_wrap = True  # type: ignore[assignment]  # Composer's per-module flag
    assert _fsdp({}, plain).shard_modules(plain[0]) is True


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"state_dict_type": "local"}, r"'local' is not supported: FSDP2 has no local"),
        ({"mixed_precision": "DEFAULT"}, r"'DEFAULT' is not supported: it casts buffers"),
        ({"mixed_precision": {"buffer_dtype": "bf16"}}, r"\['buffer_dtype'\]='bf16' cannot be honoured"),
        ({"mixed_precision": {"param_dtype": "fp8"}}, r"\['param_dtype'\]='fp8' is not valid"),
        ({"use_orig_params": False}, r"\['use_orig_params'\]=False is not possible"),
        ({"forward_prefetch": True}, r"\['forward_prefetch'\]=True is not supported: FSDP2 has no such flag"),
        ({"backward_prefetch": "BACKWARD_POST"}, r"'BACKWARD_POST' is not supported.*BACKWARD_PRE"),
        ({"activation_cpu_offload": True}, r"activation_cpu_offload'\]=True is not supported"),
        (
            {"data_parallel_shard_degree": 0},
            r"\['data_parallel_shard_degree'\]=0 is not valid. Accepted: a positive int, -1",
        ),
        ({"load_monolith_rank0_only": True}, r"load_monolith_rank0_only'\]=True is not supported: every rank reads"),
        ({"sharding_strategy": "ZERO_SHARD"}, r"parallelism_config\['fsdp'\]: sharding_strategy='ZERO_SHARD' is not"),
        ({"sharding_strategy": "FULL_SHARD", "reshard_after_forward": False}, r"set the same thing"),
        ({"flatten_parameters": True}, r"\['flatten_parameters'\], which FSDPStrategy cannot take"),
        ({"cpu_offload": "yes"}, r"\['cpu_offload'\]='yes' is not valid\. Accepted: True or False"),
    ],
)
def test_parallelism_config_refuses_what_has_no_mapping_by_name(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _fsdp(config)


def _colwise() -> Any:
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel()


def test_parallelism_config_degrees_are_an_hsdp_mesh_of_any_shape() -> None:
    from fabric.strategies import MeshPlan

    strategy = _fsdp({"data_parallel_shard_degree": 2, "data_parallel_replicate_degree": 2})
    assert strategy.planned_mesh() == MeshPlan(data_parallel_replicate=2, data_parallel=2)
    assert _fsdp({"data_parallel_replicate_degree": 4}).planned_mesh() == MeshPlan(data_parallel_replicate=4)
    assert _fsdp({"data_parallel_shard_degree": -1}).planned_mesh() == MeshPlan()  # Composer's defaults: plain FSDP
    hybrid = _fsdp({"sharding_strategy": "HYBRID_SHARD"})
    assert hybrid.hybrid_shard and hybrid.mesh_plan_given is None  # no degrees: a replica per node, as before


def test_parallelism_config_tp_applies_the_layer_plan_over_the_tensor_parallel_dimension() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel

    from fabric.strategies import MeshPlan, ModelParallelStrategy

    config = {
        "fsdp": {
            "data_parallel_replicate_degree": 2,
            "sharding_strategy": "SHARD_GRAD_OP",
            "state_dict_type": "sharded",
        },
        "tp": {"tensor_parallel_degree": 2, "layer_plan": {"blocks.*.linear": ColwiseParallel()}},
    }
    model = Stack()
    strategy = translate_fabric_choices({}, None, None, config, model)["strategy"]
    assert isinstance(strategy, ModelParallelStrategy)
    assert strategy.planned_mesh() == MeshPlan(data_parallel_replicate=2, tensor_parallel=2)
    assert strategy.reshard_after_forward is False and strategy.state_dict_type == "sharded"
    units = [module for module in model.modules() if strategy.shard_modules(module)]
    assert units == list(model.blocks)  # Composer's fsdp_wrap_fn still chooses the FSDP units
    only_tp = translate_fabric_choices({}, None, None, {"tp": config["tp"]}, Stack())["strategy"]
    assert only_tp.planned_mesh() == MeshPlan(tensor_parallel=2)
    from fabric.trainer.parallelism import TPConfig  # Composer's object, as llm-foundry passes it

    as_object = translate_fabric_choices({}, None, None, {"tp": TPConfig(**config["tp"])}, Stack())["strategy"]
    assert as_object.planned_mesh() == MeshPlan(tensor_parallel=2)


@pytest.mark.parametrize(
    ("tp", "fsdp", "message"),
    [
        (
            {"layer_plan": {"blocks.*.attention": "colwise"}},
            {},
            r"\['layer_plan'\]\['blocks.\*.attention'\]='colwise' is not valid",
        ),
        (
            {"layer_plan": {"decoder.0": _colwise()}},
            {},
            r"names 'decoder.0', which is no submodule of Stack \(its submodules: blocks",
        ),
        (
            {"tensor_parallel_degree": 0, "layer_plan": {"out": None}},
            {},
            r"\['tensor_parallel_degree'\]=0 is not valid",
        ),
        ({"tensor_parallel_size": 2}, {}, r"parallelism_config\['tp'\] has \['tensor_parallel_size'\]; accepted keys"),
    ],
)
def test_parallelism_config_tp_refuses_a_plan_that_cannot_apply(tp: dict, fsdp: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        translate_fabric_choices({}, None, None, {"fsdp": fsdp, "tp": tp}, Stack())


def test_parallelism_config_tp_with_hybrid_sharding_needs_the_replicate_degree() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel

    config = {"fsdp": {"sharding_strategy": "HYBRID_SHARD"}, "tp": {"layer_plan": {"out": ColwiseParallel()}}}
    with pytest.raises(
        ValueError, match=r"'HYBRID_SHARD' with a 'tp' section needs .*data_parallel_replicate_degree > 1"
    ):
        translate_fabric_choices({}, None, None, config, Stack())


def test_parallelism_config_refuses_per_instance_choices_and_conflicting_strategies() -> None:
    class Partial(Stack):
        def activation_checkpointing_fn(self, module: nn.Module) -> bool:
            return module is self.blocks[0]

    with pytest.raises(ValueError, match="checkpoints some Block modules but not all"):
        _fsdp({"activation_checkpointing": True}, Partial())

    class WithArguments(Stack):
        def fsdp_wrap_fn(self, module: nn.Module) -> Any:
            return {"reshard_after_forward": False} if isinstance(module, Block) else False

    with pytest.raises(ValueError, match="per-module FSDP arguments are not supported"):
        _fsdp({}, WithArguments())
    with pytest.raises(ValueError, match=r"selects FSDPStrategy, but strategy='ddp' was given too"):
        translate_fabric_choices({"strategy": "ddp"}, None, None, {"fsdp": {}}, Stack())
    with pytest.raises(ValueError, match="deepspeed_config= and parallelism_config= each choose the strategy"):
        translate_fabric_choices({}, None, {}, {"fsdp": {}}, Stack())
    with pytest.raises(ValueError, match="Pass either fabric= or parallelism_config="):
        Trainer(Regressor(), fabric=Fabric(accelerator="cpu"), parallelism_config={"fsdp": {}})
    assert translate_fabric_choices({}, None, None, {"fsdp": None}, Stack()) == {}  # no fsdp section: no strategy


def test_a_callable_is_not_taken_for_ignore_keys() -> None:
    with pytest.raises(ValueError, match="a function editing the state dict is not supported"):
        _trainer(save_ignore_keys=lambda state_dict: None)
