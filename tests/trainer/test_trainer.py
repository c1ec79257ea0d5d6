"""The Trainer's loop: event counts and order, microbatching, OOM recovery, optimizers, eval, predict, errors."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric
from fabric.trainer.core.callback import Callback
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State
from fabric.trainer.data_spec import DataSpec
from fabric.trainer.evaluation import Evaluator
from fabric.trainer.schedulers import LinearScheduler, LinearWithWarmupScheduler
from fabric.trainer.trainer import Trainer

Batch = tuple[torch.Tensor, torch.Tensor]


class Classifier(nn.Module):
    """A small MLP with the Trainer's model interface and an accuracy metric."""

    def __init__(self, features: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, classes))

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.net(batch[0])  # type: ignore[no-any-return]

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(outputs, batch[1])

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        return {"accuracy": lambda outputs, batch: (outputs.argmax(-1) == batch[1]).float().mean()}


class Recorder(Callback):
    """Records every event, in order."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def run_event(self, event: Event, state: State, logger: Any) -> None:
        self.events.append(event)

    def count(self, event: Event) -> int:
        return self.events.count(event)


def _data(samples: int = 48, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 8, generator=generator)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return TensorDataset(x, y)


def _trainer(model: nn.Module | None = None, **kwargs: Any) -> Trainer:
    model = model if model is not None else Classifier()
    options: dict[str, Any] = {
        "train_dataloader": DataLoader(_data(), batch_size=8),
        "max_duration": "2ep",
        "optimizers": torch.optim.SGD(model.parameters(), lr=0.1),
        "progress_bar": False,
        "seed": 0,
        "accelerator": "cpu",
    }
    options.update(kwargs)
    return Trainer(model=model, **options)


# --- events -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("microbatch", "microbatches"), [(None, 1), (4, 2), (3, 3)])
def test_event_counts_for_epochs_batches_and_microbatches(microbatch: int | None, microbatches: int) -> None:
    recorder = Recorder()
    trainer = _trainer(
        callbacks=[recorder],
        eval_dataloader=DataLoader(_data(16, seed=1), batch_size=8),
        eval_interval="2ba",
        device_train_microbatch_size=microbatch,
        max_duration="3ep",
    )
    trainer.fit()
    epochs, batches = 3, 3 * 6
    once = [
        Event.INIT,
        Event.BEFORE_LOAD,
        Event.AFTER_LOAD,
        Event.FIT_START,
        Event.ITERATION_START,
        Event.ITERATION_END,
        Event.ITERATION_CHECKPOINT,
        Event.FIT_END,
    ]
    per_epoch = [Event.EPOCH_START, Event.EPOCH_END, Event.EPOCH_CHECKPOINT]
    per_batch = [
        Event.BEFORE_DATALOADER,
        Event.AFTER_DATALOADER,
        Event.BATCH_START,
        Event.BEFORE_TRAIN_BATCH,
        Event.AFTER_TRAIN_BATCH,
        Event.BATCH_END,
        Event.BATCH_CHECKPOINT,
    ]
    per_microbatch = [
        Event.BEFORE_FORWARD,
        Event.AFTER_FORWARD,
        Event.BEFORE_LOSS,
        Event.AFTER_LOSS,
        Event.BEFORE_BACKWARD,
        Event.AFTER_BACKWARD,
    ]
    assert {event: recorder.count(event) for event in once} == dict.fromkeys(once, 1)
    assert {event: recorder.count(event) for event in per_epoch} == dict.fromkeys(per_epoch, epochs)
    assert {event: recorder.count(event) for event in per_batch} == dict.fromkeys(per_batch, batches)
    assert {event: recorder.count(event) for event in per_microbatch} == dict.fromkeys(
        per_microbatch, batches * microbatches
    )
    rounds = batches // 2  # every 2 batches; the last batch is one of them, so no extra end-of-training round
    assert recorder.count(Event.EVAL_BEFORE_ALL) == recorder.count(Event.EVAL_AFTER_ALL) == rounds
    assert recorder.count(Event.EVAL_START) == recorder.count(Event.EVAL_END) == rounds
    assert recorder.count(Event.EVAL_BATCH_START) == recorder.count(Event.EVAL_BATCH_END) == rounds * 2
    assert int(trainer.state.timestamp.epoch) == epochs and int(trainer.state.timestamp.batch) == batches
    assert int(trainer.state.timestamp.sample) == epochs * 48


def test_events_of_one_batch_fire_in_the_documented_order() -> None:
    recorder = Recorder()
    _trainer(callbacks=[recorder], max_duration="1ba", device_train_microbatch_size=4).fit()
    microbatch = [
        Event.BEFORE_FORWARD,
        Event.AFTER_FORWARD,
        Event.BEFORE_LOSS,
        Event.AFTER_LOSS,
        Event.BEFORE_BACKWARD,
        Event.AFTER_BACKWARD,
    ]
    assert recorder.events == [
        Event.INIT,
        Event.BEFORE_LOAD,
        Event.AFTER_LOAD,
        Event.FIT_START,
        Event.ITERATION_START,
        Event.EPOCH_START,
        Event.BEFORE_DATALOADER,
        Event.AFTER_DATALOADER,
        Event.BATCH_START,
        Event.BEFORE_TRAIN_BATCH,
        *microbatch,
        *microbatch,
        Event.AFTER_TRAIN_BATCH,
        Event.BATCH_END,
        Event.BATCH_CHECKPOINT,
        Event.ITERATION_END,
        Event.ITERATION_CHECKPOINT,
        Event.FIT_END,
    ]


def test_epoch_eval_interval_and_end_of_training_evaluate_once_each() -> None:
    recorder = Recorder()
    trainer = _trainer(
        callbacks=[recorder], eval_dataloader=DataLoader(_data(16), batch_size=8), eval_interval=2, max_duration="5ep"
    )
    trainer.fit()
    # after epochs 2 and 4, and at the end of training (epoch 5): three rounds, never two for one batch
    assert recorder.count(Event.EVAL_START) == 3


def test_stop_training_ends_after_the_current_batch() -> None:
    class StopAtThree(Callback):
        def batch_end(self, state: State, logger: Any) -> None:
            if int(state.timestamp.batch) == 3:
                state.stop_training()

    recorder = Recorder()
    trainer = _trainer(callbacks=[StopAtThree(), recorder], max_duration="10ep")
    trainer.fit()
    assert int(trainer.state.timestamp.batch) == 3
    assert recorder.count(Event.BATCH_END) == 3 and recorder.count(Event.FIT_END) == 1
    assert recorder.count(Event.EPOCH_END) == 0


# --- the step -----------------------------------------------------------------------------------


def _weights_after_one_batch(microbatch: int | str | None, model: nn.Module) -> list[torch.Tensor]:
    trainer = _trainer(
        copy.deepcopy(model),
        max_duration="1ba",
        train_dataloader=DataLoader(_data(), batch_size=12),
        device_train_microbatch_size=microbatch,
    )
    trainer.fit()
    return [p.detach().clone() for p in trainer.state.model.parameters()]


def test_microbatches_give_the_full_batch_gradient_also_with_a_smaller_last_one() -> None:
    model = Classifier()
    full = _weights_after_one_batch(None, model)
    for size in (4, 5, 1):  # 12 = 3x4 = 5+5+2 = 12x1
        for ours, reference in zip(_weights_after_one_batch(size, model), full, strict=True):
            torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    assert not torch.equal(full[0], next(model.parameters()).detach())


class OutOfMemoryAbove(Classifier):
    """Raises torch.OutOfMemoryError for batches larger than ``limit``: an OOM injected on CPU."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.sizes: list[int] = []

    def forward(self, batch: Batch) -> torch.Tensor:
        self.sizes.append(len(batch[0]))
        if len(batch[0]) > self.limit:
            raise torch.OutOfMemoryError(f"injected: batch of {len(batch[0])} > {self.limit}")
        return super().forward(batch)


def test_auto_microbatching_halves_on_out_of_memory_and_keeps_the_gradient() -> None:
    model = OutOfMemoryAbove(limit=3)
    trainer = _trainer(
        model,
        max_duration="2ba",
        train_dataloader=DataLoader(_data(), batch_size=12),
        device_train_microbatch_size="auto",
    )
    trainer.fit()
    # batch 1: 12 fails, 6 fails, then 3+3+3+3; batch 2 starts at the size found
    assert model.sizes == [12, 6, *[3] * 4, *[3] * 4]
    assert trainer.state.device_train_microbatch_size == 3


def test_auto_microbatching_gives_the_same_weights_as_no_microbatching() -> None:
    torch.manual_seed(3)
    base = OutOfMemoryAbove(limit=1000)
    limited = copy.deepcopy(base)
    limited.limit = 5
    unlimited = _weights_after_one_batch(None, base)
    auto = _weights_after_one_batch("auto", limited)
    for ours, reference in zip(auto, unlimited, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


def test_auto_microbatching_gives_up_when_one_sample_does_not_fit() -> None:
    trainer = _trainer(OutOfMemoryAbove(limit=0), max_duration="1ba", device_train_microbatch_size="auto")
    with pytest.raises(RuntimeError, match="device_train_microbatch_size=1"):
        trainer.fit()


def test_other_errors_are_not_mistaken_for_out_of_memory() -> None:
    class Broken(Classifier):
        def forward(self, batch: Batch) -> torch.Tensor:
            raise ValueError("a bug in the model")

    with pytest.raises(ValueError, match="a bug in the model"):
        _trainer(Broken(), max_duration="1ba", device_train_microbatch_size="auto").fit()


class TwoPlayers(nn.Module):
    """Two sub-networks whose losses pull a shared input in opposite directions, like a GAN's players."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 1)
        self.second = nn.Linear(8, 1)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.first(batch[0]), self.second(batch[0] + self.first(batch[0]))

    def loss(self, outputs: tuple[torch.Tensor, torch.Tensor], batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        first, second = outputs
        return first.pow(2).mean() - second.mean(), second.pow(2).mean()


def test_one_loss_per_optimizer_trains_each_optimizer_on_its_own_loss() -> None:
    torch.manual_seed(0)
    model = TwoPlayers()
    reference = copy.deepcopy(model)
    batch = next(iter(DataLoader(_data(), batch_size=8)))
    optimizers = [torch.optim.SGD(model.first.parameters(), lr=0.1), torch.optim.SGD(model.second.parameters(), lr=0.1)]
    _trainer(model, optimizers=optimizers, max_duration="1ba").fit()

    first_loss, second_loss = reference.loss(reference(batch), batch)
    first_grads = torch.autograd.grad(first_loss, list(reference.first.parameters()), retain_graph=True)
    second_grads = torch.autograd.grad(second_loss, list(reference.second.parameters()))
    expected = [p - 0.1 * g for p, g in zip(reference.first.parameters(), first_grads, strict=True)]
    expected += [p - 0.1 * g for p, g in zip(reference.second.parameters(), second_grads, strict=True)]
    for ours, theirs in zip([*model.first.parameters(), *model.second.parameters()], expected, strict=True):
        torch.testing.assert_close(ours, theirs)


def test_several_optimizers_with_one_loss_all_step() -> None:
    model = Classifier()
    before = [p.detach().clone() for p in model.parameters()]
    optimizers = [torch.optim.SGD(model.net[0].parameters(), lr=0.1), torch.optim.Adam(model.net[2].parameters())]
    _trainer(model, optimizers=optimizers, max_duration="2ba").fit()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_training_lowers_the_loss() -> None:
    losses: list[float] = []

    class Losses(Callback):
        def batch_end(self, state: State, logger: Any) -> None:
            losses.append(float(state.loss))

    _trainer(callbacks=[Losses()], max_duration="15ep").fit()
    assert sum(losses[-6:]) / 6 < 0.6 * sum(losses[:6]) / 6


# --- schedules ----------------------------------------------------------------------------------


def test_batch_k_trains_with_the_multiplier_of_batch_k() -> None:
    seen: list[float] = []

    class LearningRates(Callback):
        def before_forward(self, state: State, logger: Any) -> None:
            seen.append(state.optimizers[0].param_groups[0]["lr"])

    model = Classifier()
    scheduler = LinearScheduler(alpha_i=1.0, alpha_f=0.0, t_max="4ba")
    _trainer(model, schedulers=scheduler, callbacks=[LearningRates()], max_duration="4ba").fit()
    assert seen == pytest.approx([0.1, 0.075, 0.05, 0.025])


def test_a_warmup_in_batches_mixes_with_max_duration_in_epochs() -> None:
    seen: list[float] = []

    class LearningRates(Callback):
        def before_forward(self, state: State, logger: Any) -> None:
            seen.append(state.optimizers[0].param_groups[0]["lr"])

    scheduler = LinearWithWarmupScheduler(t_warmup="4ba", alpha_i=1.0, alpha_f=0.0)
    _trainer(schedulers=scheduler, callbacks=[LearningRates()], max_duration="2ep").fit()  # 6 batches an epoch
    expected = [0.0, 0.025, 0.05, 0.075] + [0.1 * (1 - (k - 4) / 8) for k in range(4, 12)]
    assert seen == pytest.approx(expected)


def test_pytorch_schedulers_step_every_batch_or_every_epoch() -> None:
    for every_batch, expected in ((True, 0.1 * 0.5**12), (False, 0.1 * 0.5**2)):
        model = Classifier()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        trainer = _trainer(model, optimizers=optimizer, schedulers=scheduler, step_schedulers_every_batch=every_batch)
        trainer.fit()
        assert trainer.state.optimizers[0].param_groups[0]["lr"] == pytest.approx(expected)


def test_scale_schedule_ratio_scales_max_duration() -> None:
    trainer = _trainer(max_duration="4ep", scale_schedule_ratio=0.5)
    trainer.fit()
    assert str(trainer.state.max_duration) == "2ep" and int(trainer.state.timestamp.epoch) == 2


# --- fit again, eval, predict -------------------------------------------------------------------


def test_fit_with_duration_continues_where_it_stopped_even_mid_epoch() -> None:
    model = Classifier()
    seen: list[torch.Tensor] = []

    class Inputs(Callback):
        def after_dataloader(self, state: State, logger: Any) -> None:
            seen.append(state.batch[0])

    loader = DataLoader(_data(), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0))
    trainer = _trainer(copy.deepcopy(model), train_dataloader=loader, callbacks=[Inputs()], max_duration=None)
    trainer.fit(duration="4ba")
    trainer.fit(duration="5ba")
    assert int(trainer.state.timestamp.batch) == 9 and int(trainer.state.timestamp.epoch) == 1
    in_one_go = _trainer(
        copy.deepcopy(model),
        train_dataloader=DataLoader(_data(), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0)),
        max_duration="9ba",
    )
    in_one_go.fit()
    first_epoch = torch.cat(seen[:6])
    assert sorted(first_epoch[:, 0].tolist()) == sorted(_data().tensors[0][:, 0].tolist())  # no sample twice
    for a, b in zip(trainer.state.model.parameters(), in_one_go.state.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_eval_computes_metrics_per_evaluator_label() -> None:
    model = Classifier()
    data = _data(20, seed=2)
    trainer = _trainer(model, eval_dataloader={"val": DataLoader(data, batch_size=8), "test": DataLoader(data)})
    metrics = trainer.eval()
    with torch.no_grad():
        expected = (model(data.tensors).argmax(-1) == data.tensors[1]).float().mean().item()
    assert metrics == {
        "metrics/val/accuracy": pytest.approx(expected),
        "metrics/test/accuracy": pytest.approx(expected),
    }
    assert trainer.state.model.training


def test_evaluator_subset_and_metric_names() -> None:
    recorder = Recorder()
    evaluator = Evaluator("val", DataLoader(_data(32), batch_size=8), metric_names=["accuracy"], subset_num_batches=2)
    trainer = _trainer(callbacks=[recorder], eval_dataloader=evaluator)
    trainer.eval()
    assert recorder.count(Event.EVAL_BATCH_END) == 2
    with pytest.raises(ValueError, match=r"\['f1'\].*\['accuracy'\]"):
        _trainer(eval_dataloader=Evaluator("val", DataLoader(_data()), metric_names=["f1"]))


class EvalBatches(Callback):
    """Counts each evaluator's batches, by label."""

    def __init__(self) -> None:
        self.batches: dict[str, int] = {}

    def eval_batch_end(self, state: State, logger: Any) -> None:
        label = str(state.dataloader_label)
        self.batches[label] = self.batches.get(label, 0) + 1


def test_evaluator_subsets_follow_composer_none_is_the_trainers_minus_one_is_all() -> None:
    """Composer's rules: an Evaluator's subset_num_batches None (the default) takes the Trainer's
    eval_subset_num_batches, written on it; -1 is all of its batches, whatever the Trainer's; eval()'s -1 (its
    default) leaves each evaluator its own, another value limits every one this once."""
    counter = EvalBatches()
    loader = DataLoader(_data(48), batch_size=8)  # 6 batches
    own = Evaluator("own", loader, subset_num_batches=4)
    every = Evaluator("every", loader, subset_num_batches=-1)
    default = Evaluator("default", loader)
    assert default.subset_num_batches is None
    trainer = _trainer(callbacks=[counter], eval_dataloader=[own, every, default], eval_subset_num_batches=2)
    assert default.subset_num_batches == 2
    trainer.eval()
    assert counter.batches == {"own": 4, "every": 6, "default": 2}
    counter.batches.clear()
    trainer.eval(subset_num_batches=1)
    assert counter.batches == {"own": 1, "every": 1, "default": 1}
    counter.batches.clear()
    trainer.eval()  # the limit of the call before was for that call only
    assert counter.batches == {"own": 4, "every": 6, "default": 2}
    with pytest.raises(ValueError, match=r"subset_num_batches=0 must be -1 \(all\), a positive int or None"):
        Evaluator("bad", loader, subset_num_batches=0)


def test_eval_of_other_dataloaders_leaves_the_evaluators_of_fit_in_place() -> None:
    """trainer.eval(eval_dataloader=X) evaluates X this once, all its batches unless it says otherwise (Composer's
    eval); the evaluators fit runs are still the Trainer's, with their subsets."""
    counter = EvalBatches()
    fit_evaluator = Evaluator("fit", DataLoader(_data(48), batch_size=8))
    trainer = _trainer(
        callbacks=[counter], eval_dataloader=fit_evaluator, eval_subset_num_batches=3, max_duration="1ep"
    )
    metrics = trainer.eval(eval_dataloader={"other": DataLoader(_data(40), batch_size=8)})
    assert counter.batches == {"other": 5} and set(metrics) == {"metrics/other/accuracy"}
    counter.batches.clear()
    trainer.fit()
    assert counter.batches == {"fit": 3}  # once, at the end of the epoch


def test_an_evaluators_dataloader_is_a_data_spec_counting_the_datasets_samples_as_in_composer() -> None:
    """Composer's Evaluator.dataloader is a DataSpec (llm-foundry's eval gauntlet reads its num_samples); a DataSpec
    takes num_samples and num_tokens as Composer's does."""
    loader = DataLoader(_data(20), batch_size=8)
    evaluator = Evaluator("val", loader)
    assert isinstance(evaluator.dataloader, DataSpec) and evaluator.dataloader.dataloader is loader
    assert evaluator.dataloader.num_samples == 20 and evaluator.dataloader.num_tokens is None
    given = DataSpec(loader, 7, num_tokens=70)
    assert (given.num_samples, given.num_tokens) == (7, 70)
    assert DataSpec(iter([1, 2])).num_samples is None  # no dataset to count
    with pytest.raises(ValueError, match=r"num_samples=-1\) must be a non-negative int or None"):
        DataSpec(loader, num_samples=-1)
    trainer = _trainer(eval_dataloader=evaluator)
    assert trainer.eval()["metrics/val/accuracy"] >= 0.0


def test_a_callback_takes_and_ignores_arguments_as_composers_does() -> None:
    """llm-foundry's EvalOutputLogging calls super().__init__(self, *args, **kwargs)."""

    class Passing(Callback):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(self, *args, **kwargs)
            self.made = True

    assert Passing(1, flag=True).made


class ForwardSizes(Callback):
    """Records the batch size at every eval forward, and the batch and outputs each eval batch ends with."""

    def __init__(self) -> None:
        self.forwards: list[int] = []
        self.batch_ends: list[tuple[int, tuple[int, ...]]] = []

    def eval_after_forward(self, state: State, logger: Any) -> None:
        self.forwards.append(len(state.batch[0]))

    def eval_batch_end(self, state: State, logger: Any) -> None:
        self.batch_ends.append((len(state.batch[0]), tuple(state.outputs.shape)))


@pytest.mark.parametrize(
    ("size", "tried", "forwards"),
    [(3, [3, 3, 2, 3, 3, 2, 3, 1], [3, 3, 2, 3, 3, 2, 3, 1]), ("auto", [8, 4, *[2] * 10], [2] * 10)],
)
def test_eval_microbatches_give_the_whole_batch_metrics(size: int | str, tried: list[int], forwards: list[int]) -> None:
    """Composer's Evaluator(device_eval_microbatch_size=) was a TypeError. With "auto" the model fails above 3
    samples: the batch of 8 is retried at 4, then 2, and no half-finished try is counted in the metric."""
    model = OutOfMemoryAbove(limit=3 if size == "auto" else 100)
    data = _data(20, seed=3)
    sizes = ForwardSizes()
    loader = DataLoader(data, batch_size=8)
    trainer = _trainer(
        model, callbacks=[sizes], eval_dataloader=Evaluator("val", loader, device_eval_microbatch_size=size)
    )
    metrics = trainer.eval()
    with torch.no_grad():
        expected = (Classifier.forward(model, data.tensors).argmax(-1) == data.tensors[1]).float().mean().item()
    assert metrics == {"metrics/val/accuracy": pytest.approx(expected)}
    assert (model.sizes, sizes.forwards) == (tried, forwards)
    assert sizes.batch_ends == [(8, (8, 3)), (8, (8, 3)), (4, (4, 3))]  # the whole batch and its joined outputs
    assert trainer.state.device_eval_microbatch_size == (2 if size == "auto" else 3)


@pytest.mark.parametrize("size", [0, -2, 1.5, "half", True])
def test_an_eval_microbatch_size_that_is_no_size_is_refused_naming_it(size: Any) -> None:
    with pytest.raises(
        ValueError, match=rf"device_eval_microbatch_size={re.escape(repr(size))} must be a positive int"
    ):
        Evaluator("val", DataLoader(_data()), device_eval_microbatch_size=size)


def test_predict_returns_outputs_or_streams_them_to_a_callback() -> None:
    model = Classifier()
    data = _data(20)
    trainer = _trainer(model)
    outputs = trainer.predict(DataLoader(data, batch_size=8))
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(outputs), model(data.tensors))
    streamed: list[torch.Tensor] = []

    class Stream(Callback):
        def predict_batch_end(self, state: State, logger: Any) -> None:
            streamed.append(state.outputs)

    trainer = _trainer(model, callbacks=[Stream()])
    assert trainer.predict(DataLoader(data, batch_size=8), return_outputs=False) == []
    assert [len(chunk) for chunk in streamed] == [8, 8, 4]


# --- choices and errors -------------------------------------------------------------------------


def test_precision_takes_composer_aliases_and_a_ready_fabric_is_used_as_is() -> None:
    trainer = _trainer(precision="amp_bf16")
    assert type(trainer.fabric.strategy.precision).__name__ == "MixedPrecision"
    fabric = Fabric(accelerator="cpu", devices=1)
    model = Classifier()
    trainer = Trainer(model=model, fabric=fabric, optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
    assert trainer.fabric is fabric


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_duration": "1.5ep"}, "1.5ep"),
        ({"max_duration": "0.5dur"}, "must be a positive time in ep, ba, sp or tok"),
        ({"device_train_microbatch_size": 0}, "device_train_microbatch_size=0"),
        ({"eval_interval": "10xx"}, "eval_interval='10xx'"),
        ({"fabric": "not-used", "accelerator": "cpu"}, "either fabric= or the Fabric choices"),
        ({"learning_rate": 0.1}, "unexpected arguments \\['learning_rate'\\]"),
        ({"scale_schedule_ratio": 0}, "scale_schedule_ratio=0"),
        ({"loggers": [object()]}, "LoggerDestination"),
    ],
)
def test_bad_options_fail_at_construction_naming_the_value(options: dict[str, Any], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        _trainer(**options)


def test_a_model_without_loss_is_refused() -> None:
    with pytest.raises(TypeError, match="no loss\\(outputs, batch\\)"):
        _trainer(nn.Linear(8, 3))


def test_fit_without_duration_or_data_says_what_is_missing() -> None:
    with pytest.raises(ValueError, match="fit\\(\\) needs a duration"):
        _trainer(max_duration=None).fit()
    with pytest.raises(ValueError, match="fit\\(\\) needs a train_dataloader"):
        _trainer(train_dataloader=None).fit()


def test_progress_bars_count_training_and_evaluation_batches() -> None:
    import io

    from fabric.trainer.loggers.progress_bar import ProgressBarLogger

    stream = io.StringIO()
    trainer = _trainer(
        loggers=[ProgressBarLogger(stream=stream)],
        eval_dataloader=DataLoader(_data(24), batch_size=8),
        max_duration="1ep",
    )
    trainer.fit()
    trainer.close()
    output = stream.getvalue()
    assert "6/6" in output  # the training bar: 6 batches in the run
    assert re.search(r"eval: .*\| *\d/3 ", output)  # the eval bar knows its 3 batches


def test_torchmetrics_metrics_are_updated_through_the_model_and_computed_per_round() -> None:
    torchmetrics = pytest.importorskip("torchmetrics")

    class WithTorchmetrics(Classifier):
        def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
            return {"accuracy": torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")}

    model = WithTorchmetrics()
    data = _data(20, seed=4)
    trainer = _trainer(model, eval_dataloader=DataLoader(data, batch_size=8))
    with torch.no_grad():
        expected = (model(data.tensors).argmax(-1) == data.tensors[1]).float().mean().item()
    assert trainer.eval() == {"metrics/eval/accuracy": pytest.approx(expected)}
    assert trainer.eval() == {"metrics/eval/accuracy": pytest.approx(expected)}  # reset between rounds


def test_evaluating_does_not_change_training() -> None:
    class DropoutClassifier(Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))

    torch.manual_seed(0)
    model = DropoutClassifier()
    weights = []
    for eval_interval in ("1ba", "1000ba"):
        trainer = _trainer(
            copy.deepcopy(model),
            train_dataloader=DataLoader(_data(), batch_size=8, shuffle=True),
            eval_dataloader=DataLoader(_data(16), batch_size=8, shuffle=True),
            eval_interval=eval_interval,
            max_duration="8ba",
        )
        trainer.fit()
        weights.append([p.detach() for p in trainer.state.model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))
