"""Built-in callbacks, driven through the Engine with a hand-set State: the numbers they log and when they stop."""

from __future__ import annotations

import inspect
import math
import operator
import sys
import warnings
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric
from fabric.trainer.callbacks import (
    EarlyStopper,
    LRMonitor,
    NaNMonitor,
    OptimizerMonitor,
    RuntimeEstimator,
    SpeedMonitor,
    ThresholdStopper,
)
from fabric.trainer.core.callback import Callback
from fabric.trainer.core.engine import Engine
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time
from fabric.trainer.loggers import InMemoryLogger, Logger


class Rig:
    """A State, a Logger holding an InMemoryLogger, and an Engine running ``callbacks``: a Trainer without the loop."""

    def __init__(self, *callbacks: Callback, max_duration: str = "100ba", model: nn.Module | None = None) -> None:
        self.state = State(model=model or nn.Linear(2, 1), max_duration=Time.from_timestring(max_duration))
        self.memory = InMemoryLogger()
        self.engine = Engine(self.state, Logger(self.state, [self.memory]), callbacks=callbacks)

    def train_batch(self, samples: int = 4, tokens: int = 0, seconds: float = 1.0) -> None:
        """BATCH_START, the clock advancing by one batch of ``samples``/``tokens`` taking ``seconds``, BATCH_END."""
        self.engine.run_event(Event.BATCH_START)
        self.state.timestamp = self.state.timestamp.to_next_batch(samples, tokens, timedelta(seconds=seconds))
        self.engine.run_event(Event.BATCH_END)

    def end_epoch(self) -> None:
        self.state.timestamp = self.state.timestamp.to_next_epoch()
        self.engine.run_event(Event.EPOCH_END)

    def evaluate(self, label: str, metrics: dict[str, float]) -> None:
        """An evaluation by ``label`` that computed ``metrics`` (names without the ``metrics/<label>/`` prefix)."""
        self.state.dataloader_label = label
        self.engine.run_event(Event.EVAL_START)
        self.state.metrics.update({f"metrics/{label}/{name}": value for name, value in metrics.items()})
        self.engine.run_event(Event.EVAL_END)
        self.state.dataloader_label = None

    def logged(self, name: str) -> list[float]:
        return [value for _, value in self.memory.data.get(name, [])]


# --- SpeedMonitor -----------------------------------------------------------------------------------


def test_speed_monitor_averages_global_counts_over_the_window_of_batch_times() -> None:
    rig = Rig(SpeedMonitor(window_size=2))
    rig.train_batch(samples=8, tokens=80, seconds=1.0)
    rig.train_batch(samples=16, tokens=160, seconds=3.0)
    assert rig.memory.most_recent_values["throughput/samples_per_sec"] == pytest.approx(24 / 4)
    assert rig.memory.most_recent_values["throughput/tokens_per_sec"] == pytest.approx(240 / 4)
    assert rig.memory.most_recent_values["throughput/batches_per_sec"] == pytest.approx(2 / 4)
    rig.train_batch(samples=4, tokens=40, seconds=1.0)  # the first batch leaves the window
    assert rig.memory.most_recent_values["throughput/samples_per_sec"] == pytest.approx(20 / 4)
    assert rig.memory.most_recent_values["throughput/batches_per_sec"] == pytest.approx(2 / 4)
    assert rig.logged("time/train") == pytest.approx([1.0, 4.0, 5.0])
    assert len(rig.logged("throughput/samples_per_sec")) == 3  # logged from the first batch on


def test_speed_monitor_leaves_out_tokens_when_batches_have_none() -> None:
    rig = Rig(SpeedMonitor())
    rig.train_batch(samples=8)
    assert "throughput/samples_per_sec" in rig.memory.most_recent_values
    assert "throughput/tokens_per_sec" not in rig.memory.most_recent_values


class FlopsModel(nn.Linear):
    def __init__(self) -> None:
        super().__init__(2, 1)

    def flops_per_batch(self, batch: torch.Tensor) -> float:
        return 100.0 * len(batch)


@pytest.mark.parametrize(
    ("world_size", "shares"), [(1, 1), (2, 2), (2, 1)], ids=["one_rank", "two_data_parallel_ranks", "tensor_parallel_2"]
)
def test_speed_monitor_mfu_counts_the_flops_of_every_batch_once(world_size: int, shares: int) -> None:
    """Every rank's batch counts, except that the ranks of one tensor-parallel group train one batch together
    (``strategy.batch_shares``); the peak is every device's."""
    rig = Rig(SpeedMonitor(flops_available_per_device=1000.0), model=FlopsModel())
    rig.state.fabric = SimpleNamespace(world_size=world_size, strategy=SimpleNamespace(batch_shares=shares))
    rig.state.batch = torch.zeros(4, 2)  # this rank's batch: 400 FLOPs
    rig.engine.run_event(Event.FIT_START)
    rig.train_batch(samples=4 * shares, seconds=2.0)
    flops_per_sec = 400.0 * shares / 2.0
    assert rig.memory.most_recent_values["throughput/flops_per_sec"] == pytest.approx(flops_per_sec)
    assert rig.memory.most_recent_values["throughput/mfu"] == pytest.approx(flops_per_sec / (1000.0 * world_size))


def test_speed_monitor_needs_flops_per_batch_for_mfu() -> None:
    rig = Rig(SpeedMonitor(flops_available_per_device=1e12))
    with pytest.raises(ValueError, match="Linear has no flops_per_batch"):
        rig.engine.run_event(Event.FIT_START)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [({"window_size": 0}, "window_size must be"), ({"flops_available_per_device": -1.0}, "peak FLOP/s")],
)
def test_speed_monitor_rejects_bad_arguments(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeedMonitor(**arguments)


# --- LRMonitor and OptimizerMonitor --------------------------------------------------------------


def test_lr_monitor_logs_every_group_of_every_optimizer() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    rig = Rig(LRMonitor(), model=model)
    adam_groups: list[dict[str, Any]] = [
        {"params": model[0].parameters(), "lr": 0.01},
        {"params": model[1].parameters()},  # the optimizer's default lr
    ]
    rig.state.optimizers = [
        torch.optim.SGD(model[0].parameters(), lr=0.1),
        torch.optim.SGD(model[1].parameters(), lr=0.2),
        torch.optim.Adam(adam_groups, lr=0.03),
    ]
    rig.train_batch()
    assert rig.memory.most_recent_values == {
        "lr-SGD/group0": pytest.approx(0.1),
        "lr-SGD-1/group0": pytest.approx(0.2),
        "lr-Adam/group0": pytest.approx(0.01),
        "lr-Adam/group1": pytest.approx(0.03),
    }


def test_monitors_name_the_users_optimizer_and_parameters_not_fabrics_wrappers() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    model, optimizer = fabric.setup(nn.Sequential(nn.Linear(2, 1)), torch.optim.SGD(nn.Linear(1, 1).parameters(), 0.5))
    rig = Rig(LRMonitor(), OptimizerMonitor(log_per_layer=True), model=model)
    rig.state.optimizers = [optimizer]
    rig.engine.run_event(Event.AFTER_TRAIN_BATCH)
    rig.train_batch()
    assert type(optimizer).__name__ != "SGD"  # the wrapper is a subclass with its own name
    assert rig.memory.most_recent_values["lr-SGD/group0"] == pytest.approx(0.5)
    assert "l2_norm/param/0.weight" in rig.memory.most_recent_values


def _trained_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    model[0].bias.requires_grad_(False)
    model(torch.randn(5, 3)).pow(2).mean().backward()
    return model


def test_optimizer_monitor_global_norms_equal_torchs() -> None:
    model = _trained_model()
    rig = Rig(OptimizerMonitor(), model=model)
    rig.engine.run_event(Event.AFTER_TRAIN_BATCH)
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(trained, max_norm=math.inf)
    param_norm = torch.linalg.vector_norm(torch.cat([parameter.detach().flatten() for parameter in trained]))
    assert rig.memory.most_recent_values == {
        "l2_norm/grad/global": pytest.approx(grad_norm.item()),
        "l2_norm/param/global": pytest.approx(param_norm.item()),
    }
    assert [step for step, _ in rig.memory.data["l2_norm/grad/global"]] == [1]  # the step of the batch being trained


def test_optimizer_monitor_per_layer_norms_skip_frozen_parameters() -> None:
    model = _trained_model()
    rig = Rig(OptimizerMonitor(log_per_layer=True), model=model)
    rig.engine.run_event(Event.AFTER_TRAIN_BATCH)
    values = rig.memory.most_recent_values
    for name in ("0.weight", "2.weight", "2.bias"):
        parameter = model.get_parameter(name)
        assert parameter.grad is not None
        assert values[f"l2_norm/grad/{name}"] == pytest.approx(torch.linalg.vector_norm(parameter.grad).item())
        assert values[f"l2_norm/param/{name}"] == pytest.approx(torch.linalg.vector_norm(parameter).item())
    assert "l2_norm/param/0.bias" not in values and "l2_norm/grad/0.bias" not in values


# --- EarlyStopper and ThresholdStopper ------------------------------------------------------------


def _epoch_with_eval(rig: Rig, label: str, value: float, metric: str = "accuracy") -> None:
    """Two batches, the end of the epoch, then an evaluation by ``label`` that computed ``metric = value``."""
    for _ in range(2):
        rig.train_batch()
    rig.end_epoch()
    rig.evaluate(label, {metric: value})


def test_early_stopper_stops_once_patience_has_passed_without_improvement() -> None:
    rig = Rig(EarlyStopper("accuracy", patience="2ep"))
    for value in (0.5, 0.6, 0.55):  # best at epoch 2, then one epoch without improvement
        _epoch_with_eval(rig, "eval", value)
        assert not rig.state.finished
    _epoch_with_eval(rig, "eval", 0.58)  # two epochs since the best
    assert rig.state.finished
    assert rig.state.max_duration == Time.from_batch(8)


def test_early_stopper_counts_patience_in_batches_on_train_metrics() -> None:
    rig = Rig(EarlyStopper("loss", dataloader_label="train", patience="3ba"))
    for batch, loss in enumerate([1.0, 0.8, 0.9, 0.85, 0.8], start=1):  # default for a loss: lower is better
        rig.state.metrics["metrics/train/loss"] = loss
        rig.train_batch()
        assert rig.state.finished == (batch == 5), batch
    assert rig.state.max_duration == Time.from_batch(5)


def test_early_stopper_ignores_improvements_below_min_delta_and_other_evaluators() -> None:
    stopper = EarlyStopper("accuracy", dataloader_label="val", min_delta=0.05, patience=1)
    rig = Rig(stopper)
    _epoch_with_eval(rig, "val", 0.5)
    _epoch_with_eval(rig, "other", 0.1)  # not the watched evaluator: no effect
    assert not rig.state.finished
    _epoch_with_eval(rig, "val", 0.54)  # better, but by less than min_delta
    assert rig.state.finished
    assert stopper.best == 0.5


def test_early_stopper_comparator_decides_what_is_better() -> None:
    rig = Rig(EarlyStopper("distance", comparator=operator.lt, patience="1ep"))
    _epoch_with_eval(rig, "eval", 5.0, metric="distance")
    _epoch_with_eval(rig, "eval", 3.0, metric="distance")  # better only because lower is better here
    assert not rig.state.finished
    _epoch_with_eval(rig, "eval", 4.0, metric="distance")
    assert rig.state.finished


def test_early_stopper_resumes_from_its_state_dict() -> None:
    before = EarlyStopper("accuracy", patience="2ep")
    first = Rig(before)
    _epoch_with_eval(first, "eval", 0.9)
    _epoch_with_eval(first, "eval", 0.8)
    after = EarlyStopper("accuracy", patience="2ep")
    after.load_state_dict(before.state_dict())
    resumed = Rig(after)
    resumed.state.timestamp = first.state.timestamp
    _epoch_with_eval(resumed, "eval", 0.85)  # two epochs after the best, which the first run saw
    assert resumed.state.finished
    assert after.best == 0.9


def test_a_missing_metric_is_a_clear_error() -> None:
    rig = Rig(EarlyStopper("f1"))
    with pytest.raises(ValueError, match=r"monitors 'metrics/eval/f1'.*Available: \['metrics/eval/accuracy'\]"):
        rig.evaluate("eval", {"accuracy": 1.0})


@pytest.mark.parametrize("patience", ["0ep", "10sp", "0.5dur", "soon", 1.5, -1])
def test_early_stopper_rejects_a_bad_patience(patience: Any) -> None:
    with pytest.raises(ValueError, match=f"patience={patience!r} is not a positive number of epochs or batches"):
        EarlyStopper("accuracy", patience=patience)


@pytest.mark.parametrize(("comparator", "problem"), [("lt", "is not callable"), (torch.less, "fails on two floats")])
def test_stoppers_reject_a_bad_comparator(comparator: Any, problem: str) -> None:
    with pytest.raises(TypeError, match=problem):
        EarlyStopper("accuracy", comparator=comparator)
    with pytest.raises(TypeError, match=problem):
        ThresholdStopper("accuracy", "eval", 0.5, comparator=comparator)


def test_threshold_stopper_on_batch_stops_after_the_batch_that_crossed() -> None:
    rig = Rig(ThresholdStopper("loss", "train", threshold=0.5, stop_on_batch=True))
    for loss in (0.9, 0.7, 0.4):
        rig.state.metrics["metrics/train/loss"] = loss
        rig.train_batch()
    assert rig.state.max_duration == Time.from_batch(3)


def test_threshold_stopper_finishes_the_epoch_by_default() -> None:
    rig = Rig(ThresholdStopper("accuracy", "train", threshold=0.9))
    rig.state.dataloader_len = 4
    rig.state.metrics["metrics/train/accuracy"] = 0.95
    rig.train_batch()
    assert not rig.state.finished
    for _ in range(3):
        rig.train_batch()
    rig.end_epoch()
    assert rig.state.max_duration == Time.from_batch(4)


def test_threshold_stopper_at_an_end_of_epoch_evaluation_stops_right_away() -> None:
    rig = Rig(ThresholdStopper("accuracy", "eval", threshold=0.9))
    _epoch_with_eval(rig, "eval", 0.8)
    assert not rig.state.finished
    _epoch_with_eval(rig, "eval", 0.91)
    assert rig.state.max_duration == Time.from_batch(4)


def test_threshold_stopper_rejects_a_non_finite_threshold() -> None:
    with pytest.raises(ValueError, match="threshold must be a finite number, got nan"):
        ThresholdStopper("accuracy", "eval", math.nan)


# --- NaNMonitor -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "loss", [torch.tensor(float("nan")), torch.tensor([1.0, float("inf")]), {"total": torch.tensor(-math.inf)}]
)
def test_nan_monitor_names_the_batch_with_a_non_finite_loss(loss: Any) -> None:
    rig = Rig(NaNMonitor())
    for _ in range(3):
        rig.train_batch()
    rig.state.loss = loss
    with pytest.raises(RuntimeError, match="not finite at batch index 3"):
        rig.engine.run_event(Event.AFTER_LOSS)


def test_nan_monitor_lets_finite_losses_through() -> None:
    rig = Rig(NaNMonitor())
    rig.state.loss = {"total": torch.tensor(2.0), "parts": [torch.tensor(1.0), 1.0]}
    rig.engine.run_event(Event.AFTER_LOSS)


# --- RuntimeEstimator -------------------------------------------------------------------------------


def test_runtime_estimator_extrapolates_the_pace_after_the_warm_up() -> None:
    rig = Rig(RuntimeEstimator(skip_batches=1), max_duration="10ba")
    rig.train_batch(seconds=5.0)  # warm-up, left out of the pace
    assert rig.logged("time/remaining_estimate") == []
    rig.train_batch(seconds=2.0)
    rig.train_batch(seconds=2.0)
    assert rig.logged("time/remaining_estimate") == pytest.approx([8 * 2.0, 7 * 2.0])


def test_runtime_estimator_counts_batches_within_epochs() -> None:
    rig = Rig(RuntimeEstimator(skip_batches=0), max_duration="2ep")
    rig.state.dataloader_len = 4
    rig.train_batch(seconds=1.5)
    rig.train_batch(seconds=1.5)
    assert rig.logged("time/remaining_estimate") == pytest.approx([7 * 1.5, 6 * 1.5])


def test_runtime_estimator_rejects_negative_skips() -> None:
    with pytest.raises(ValueError, match="skip_batches must be"):
        RuntimeEstimator(skip_batches=-1)


# --- with the Trainer -------------------------------------------------------------------------------


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 1)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        outputs: torch.Tensor = self.linear(batch[0])
        return outputs

    def loss(self, outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(outputs, batch[1])


def test_a_trainer_fit_logs_speed_and_learning_rate_every_batch() -> None:
    from fabric.trainer.trainer import Trainer

    data = TensorDataset(torch.randn(24, 3), torch.randn(24, 1))
    model = Regression()
    memory = InMemoryLogger()
    trainer = Trainer(
        model,
        DataLoader(data, batch_size=8),
        max_duration="2ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
        callbacks=[SpeedMonitor(window_size=4), LRMonitor()],
        loggers=[memory],
        progress_bar=False,
        accelerator="cpu",
        devices=1,
        seed=0,
    )
    trainer.fit()
    trainer.close()
    for name in ("throughput/samples_per_sec", "throughput/batches_per_sec", "time/train", "lr-SGD/group0"):
        assert [step for step, _ in memory.data[name]] == [1, 2, 3, 4, 5, 6], name
    assert all(value == pytest.approx(0.05) for _, value in memory.data["lr-SGD/group0"])
    assert all(value > 0 for _, value in memory.data["throughput/samples_per_sec"])
    assert len(memory.data["loss/train/total"]) == 6


# --- Hook names -------------------------------------------------------------------------------------


def test_the_hooks_are_written_in_the_class_one_per_event() -> None:
    hooks = {
        name
        for name, method in vars(Callback).items()
        if callable(method) and list(inspect.signature(method).parameters) == ["self", "state", "logger"]
    }
    assert hooks - {"close"} == {event.value for event in Event}  # close(state, logger) is Trainer.close()'s
    assert "setattr" not in inspect.getsource(sys.modules[Callback.__module__])


def test_a_misspelt_hook_is_named_with_the_closest_event_once() -> None:
    class Misspelt(Callback):
        def batch_ned(self, state: State, logger: Any) -> None:
            pass

        def fit_begin(self, state: State, logger: Any) -> None:
            pass

        def summary(self) -> str:  # a helper: far from every event and not shaped like a hook
            return "ok"

    with pytest.warns(UserWarning) as caught:
        Rig(Misspelt())
    messages = sorted(str(warning.message) for warning in caught)
    assert len(messages) == 2
    assert messages[0].startswith("Misspelt.batch_ned matches no event") and "'batch_end'" in messages[0]
    assert messages[1].startswith("Misspelt.fit_begin matches no event") and "did you mean 'fit_" in messages[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Rig(Misspelt())  # the class was checked already


def test_built_in_callbacks_and_loggers_raise_no_hook_warning() -> None:
    from fabric.trainer.loggers import ConsoleLogger, FileLogger, InMemoryLogger, ProgressBarLogger

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Rig(
            EarlyStopper("accuracy", "val"),
            LRMonitor(),
            NaNMonitor(),
            OptimizerMonitor(),
            RuntimeEstimator(),
            SpeedMonitor(),
            ThresholdStopper("accuracy", "val", 0.9),
            ConsoleLogger(),
            FileLogger("unused.txt"),
            InMemoryLogger(),
            ProgressBarLogger(),
        )
