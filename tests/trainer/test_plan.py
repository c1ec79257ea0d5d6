"""The Trainer's plan: every argument of ``Trainer(...)`` and ``fit(...)`` is checked once, in one place, before
the Trainer launches a process or changes anything."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric
from fabric.trainer.core.callback import Callback
from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State
from fabric.trainer.evaluation import Evaluator
from fabric.trainer.plan import SETTING_NAMES, LoopSettings, plan_stage
from fabric.trainer.schedulers import ConstantScheduler
from fabric.trainer.trainer import Trainer


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.net(batch[0]).squeeze(-1)

    def loss(self, outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(outputs, batch[1])


def _loader(samples: int = 16) -> DataLoader[Any]:
    x = torch.randn(samples, 4, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1)), batch_size=4)


def _trainer(**options: Any) -> Trainer:
    model = Regressor()
    arguments: dict[str, Any] = {
        "train_dataloader": _loader(),
        "optimizers": torch.optim.SGD(model.parameters(), lr=0.1),
        "progress_bar": False,
        "seed": 0,
        "accelerator": "cpu",
    }
    return Trainer(model=model, **(arguments | options))


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("run_name", "a/b", r"run_name='a/b' must be a non-empty name without '/'"),
        ("accumulate_train_batch_on_tokens", "yes", r"accumulate_train_batch_on_tokens='yes' is not valid"),
        ("step_schedulers_every_batch", "yes", r"step_schedulers_every_batch='yes' is not valid"),
        ("profiler", object(), r"profiler must be a fabric.trainer.profiler.Profiler"),
        ("device_train_microbatch_size", "auto", r"device_train_microbatch_size='auto' on several ranks needs"),
    ],
)
def test_a_bad_argument_is_refused_before_the_trainer_launches_a_process(
    name: str, value: Any, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks under FSDP: a refusal after ``fabric.launch()`` would come once the other rank runs the script."""
    launches: list[Fabric] = []
    monkeypatch.setattr(Fabric, "launch", lambda fabric, *args, **kwargs: launches.append(fabric))
    with pytest.raises((ValueError, TypeError), match=message):
        _trainer(**{name: value}, devices=2, strategy="fsdp")
    assert launches == []


def test_trainer_and_fit_settings_are_one_checked_description() -> None:
    trainer = _trainer(train_subset_num_batches=3, eval_interval="2ba")
    assert trainer.settings == LoopSettings(train_subset_num_batches=3, eval_interval="2ba")
    with pytest.raises(dataclasses.FrozenInstanceError):
        trainer.settings.train_subset_num_batches = 1  # type: ignore[misc]
    trainer.fit(duration="1ba", train_subset_num_batches=2, step_schedulers_every_batch=False)
    assert trainer.settings == LoopSettings(
        train_subset_num_batches=2, eval_interval="2ba", step_schedulers_every_batch=False
    )
    assert trainer.state.dataloader_len == 2


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("train_subset_num_batches", 0),
        ("spin_dataloaders", "no"),
        ("eval_subset_num_batches", 1.5),
        ("eval_interval", "soon"),
        ("step_schedulers_every_batch", 1),
        ("device_train_microbatch_size", 0),
        ("device_train_microbatch_size", True),
    ],
)
def test_trainer_fit_and_the_settings_refuse_a_bad_setting_with_the_same_message(name: str, value: Any) -> None:
    with pytest.raises(ValueError) as direct:
        LoopSettings(**{name: value})
    message = re.escape(str(direct.value))
    with pytest.raises(ValueError, match=message):
        _trainer(**{name: value})
    trainer = _trainer(eval_dataloader=_loader())
    with pytest.raises(ValueError, match=message):
        trainer.fit(duration="1ba", **{name: value})
    assert int(trainer.state.timestamp.batch) == 0  # nothing trained, nothing changed
    assert trainer.settings == LoopSettings()


def test_every_setting_is_a_trainer_and_a_fit_parameter_but_grad_accum() -> None:
    import inspect

    init, fit = inspect.signature(Trainer.__init__).parameters, inspect.signature(Trainer.fit).parameters
    assert [name for name in SETTING_NAMES if name not in init] == []
    assert [name for name in SETTING_NAMES if name not in fit] == ["grad_accum"]


def test_a_microbatch_size_given_to_fit_replaces_grad_accum() -> None:
    trainer = _trainer(grad_accum=2)
    assert (trainer.settings.grad_accum, trainer.state.device_train_microbatch_size) == (2, 2)
    trainer.fit(duration="1ba", device_train_microbatch_size=1)
    assert trainer.settings.grad_accum is None
    assert trainer.state.device_train_microbatch_size == 1


def test_a_stage_plan_keeps_the_settings_fit_was_not_given() -> None:
    settings = LoopSettings(train_subset_num_batches=5, eval_subset_num_batches=2)
    arguments: dict[str, Any] = {
        "train_dataloader": None,
        "train_subset_num_batches": None,
        "spin_dataloaders": None,
        "duration": "3ba",
        "reset_time": False,
        "schedulers": None,
        "scale_schedule_ratio": 1.0,
        "step_schedulers_every_batch": None,
        "eval_dataloader": None,
        "eval_subset_num_batches": 4,
        "eval_interval": None,
        "optimizers": None,
        "precision": None,
        "device_train_microbatch_size": None,
    }
    plan = plan_stage(arguments, settings, Fabric(accelerator="cpu"), train_loader=_loader(), evaluates=True)
    assert plan.settings == LoopSettings(train_subset_num_batches=5, eval_subset_num_batches=4)
    assert plan.given_settings == {"eval_subset_num_batches"}
    with pytest.raises(ValueError, match=r"there is no eval_dataloader"):
        plan_stage(arguments, settings, Fabric(accelerator="cpu"), train_loader=_loader(), evaluates=False)


def test_eval_refuses_a_subset_that_is_no_count() -> None:
    trainer = _trainer(eval_dataloader=_loader())
    with pytest.raises(ValueError, match=r"subset_num_batches=0 is not valid\. Accepted: -1"):
        trainer.eval(subset_num_batches=0)


# --- refusals that came after the launch or during the set-up: now the plan's, before any state changes ----------


class Events(Callback):
    """Records every event it hears: a refusal by the plan comes before INIT."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        self.events.append(event.value)


class NoLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.net(batch[0])


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"model": NoLoss()}, TypeError, r"NoLoss has no loss\(outputs, batch\) method; the Trainer needs one"),
        (
            {"optimizers": [], "schedulers": [ConstantScheduler()]},
            ValueError,
            r"schedulers=\[.*ConstantScheduler.*\] need optimizers to schedule; pass optimizers=\.\.\. as well\.",
        ),
        (
            {"eval_dataloader": Evaluator("val", _loader(), device_eval_microbatch_size="auto")},
            ValueError,
            r"device_eval_microbatch_size='auto' on several ranks needs strategy='ddp', got FSDPStrategy",
        ),
    ],
    ids=["no-loss", "schedulers-without-optimizers", "auto-eval-microbatches"],
)
def test_what_the_set_up_refused_is_refused_by_the_plan_before_the_launch_and_init(
    options: dict[str, Any], error: type[Exception], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    launches: list[Fabric] = []
    monkeypatch.setattr(Fabric, "launch", lambda fabric, *args, **kwargs: launches.append(fabric))
    events = Events()
    model = options.pop("model", Regressor())
    with pytest.raises(error, match=message):
        Trainer(
            model=model,
            train_dataloader=_loader(),
            callbacks=[events],
            progress_bar=False,
            accelerator="cpu",
            devices=2,
            strategy="fsdp",
            **options,
        )
    assert (launches, events.events) == ([], [])


def test_fit_refuses_schedulers_without_optimizers_and_a_label_before_anything_changes() -> None:
    events = Events()
    trainer = Trainer(model=Regressor(), callbacks=[events], progress_bar=False, seed=0, accelerator="cpu")
    assert trainer.state.optimizers == []  # no train dataloader, no optimizers: none defaulted yet
    heard = list(events.events)
    with pytest.raises(ValueError, match=r"need optimizers to schedule; pass optimizers=\.\.\. as well\."):
        trainer.fit(train_dataloader=_loader(), duration="1ba", schedulers=[ConstantScheduler()])
    with pytest.raises(ValueError, match=r"train_dataloader_label='finetune'\) is not supported"):
        trainer.fit(train_dataloader=_loader(), duration="1ba", train_dataloader_label="finetune")
    assert events.events == heard  # no FIT_START, nothing trained
    assert (trainer.state.dataloader, trainer.state.max_duration, trainer.state.schedulers) == (None, None, [])


def test_plan_stage_refuses_a_train_dataloader_label_other_than_composers_default() -> None:
    arguments: dict[str, Any] = dict.fromkeys(
        ["train_dataloader", "duration", "schedulers", "eval_dataloader", "optimizers", "precision", *SETTING_NAMES]
    )
    arguments |= {"reset_time": False, "scale_schedule_ratio": 1.0, "train_dataloader_label": "pretrain"}
    with pytest.raises(ValueError, match=r"train_dataloader_label='pretrain'\) is not supported"):
        plan_stage(arguments, LoopSettings(), Fabric(accelerator="cpu"), train_loader=None, evaluates=False)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("seed", "7", r"seed='7' is not valid\. Accepted: None or an int in \[0, 4294967295\]\."),
        ("seed", 1.5, r"seed=1\.5 is not valid\. Accepted: None or an int"),
        ("seed", True, r"seed=True is not valid\. Accepted: None or an int"),
        ("seed", -1, r"seed=-1 is out of range; accepted: an int in \[0, 4294967295\]\."),
        ("seed", 2**32, r"seed=4294967296 is out of range"),
        ("progress_bar", "no", r"progress_bar='no' is not valid\. Accepted: True or False\."),
        ("progress_bar", 0, r"progress_bar=0 is not valid\. Accepted: True or False\."),
        ("load_weights_only", 1, r"load_weights_only=1 is not valid\. Accepted: True or False\."),
        ("save_weights_only", "yes", r"save_weights_only='yes' is not valid\. Accepted: True or False\."),
        ("save_overwrite", None, r"save_overwrite=None is not valid\. Accepted: True or False\."),
        ("save_async", "true", r"save_async='true' is not valid\. Accepted: True or False\."),
        ("storage_options", "s3", r"storage_options='s3' is not valid\. Accepted: None or a dict of fsspec options"),
        ("storage_options", [("key", "k")], r"storage_options=\[\('key', 'k'\)\] is not valid\. Accepted: None or"),
    ],
)
def test_an_argument_that_went_unchecked_is_refused_by_the_plan_naming_it(
    name: str, value: Any, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    launches: list[Fabric] = []
    monkeypatch.setattr(Fabric, "launch", lambda fabric, *args, **kwargs: launches.append(fabric))
    events = Events()
    with pytest.raises(ValueError, match=message):
        _trainer(**{name: value}, callbacks=[events], devices=2, strategy="fsdp")
    assert (launches, events.events) == ([], [])


def test_the_accepted_values_of_those_arguments_still_build_a_trainer(tmp_path: Path) -> None:
    trainer = _trainer(
        seed=4294967295,
        save_folder=str(tmp_path),
        save_weights_only=True,
        save_overwrite=True,
        save_async=False,
        load_weights_only=False,
        storage_options={},
    )
    assert trainer.seed == 4294967295
    assert trainer.storage_options == {}


def test_the_plan_holds_values_only_and_each_fit_gets_a_saver_of_its_own(tmp_path: Path) -> None:
    """The plan is a description: the save settings (not a saver, whose list of saves and upload state change as it
    trains), read-only option mappings; the Trainer builds its saver from the settings when it applies the plan."""
    from types import MappingProxyType

    from fabric.trainer.checkpoint.saver import CheckpointSaver, SaveSettings
    from fabric.trainer.plan import plan_trainer

    class EverySecondBatch:  # a user's interval object: the saver must call this one, not a copy
        def __init__(self) -> None:
            self.asked = 0

        def __call__(self, state: State, event: Event) -> bool:
            self.asked += 1
            return event == Event.BATCH_END and int(state.timestamp.batch) % 2 == 0

    interval = EverySecondBatch()
    parameters = inspect.signature(Trainer.__init__).parameters.values()
    arguments = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
    model = Regressor()
    arguments |= {"model": model, "save_folder": str(tmp_path), "save_interval": interval}
    arguments |= {"compile_config": {"mode": "default"}, "fabric_choices": {"accelerator": "cpu"}}
    plan = plan_trainer(arguments)
    assert plan.save == SaveSettings(str(tmp_path), save_interval=interval)
    assert isinstance(plan.compile_options, MappingProxyType) and isinstance(plan.fabric_choices, MappingProxyType)
    with pytest.raises(TypeError):
        plan.fabric_choices["accelerator"] = "cuda"  # type: ignore[index]
    trainer = _trainer(save_folder=str(tmp_path), save_interval=interval, max_duration="4ba")
    trainer.fit()
    assert isinstance(trainer.saver, CheckpointSaver) and trainer.saver.saved == [
        str(tmp_path / f"ep0-ba{batch}-rank0.pt") for batch in (2, 4)
    ]
    assert interval.asked > 0  # the user's object decided
    with pytest.raises(ValueError, match=r"save_num_checkpoints_to_keep=0 must be -1 \(all\) or positive"):
        SaveSettings(str(tmp_path), num_checkpoints_to_keep=0)
