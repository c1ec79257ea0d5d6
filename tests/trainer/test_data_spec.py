"""DataSpec: custom batch types split, count and transform through the Trainer as the spec says."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric.trainer import DataSpec, Trainer
from fabric.trainer.evaluation import Evaluator
from fabric.trainer.schedulers import LinearWithWarmupScheduler


class Rows:
    """A batch type the default functions do not understand: no tensors reachable as attributes of a container."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> None:
        self._data = (x, y, mask)

    @property
    def x(self) -> torch.Tensor:
        return self._data[0]

    @property
    def y(self) -> torch.Tensor:
        return self._data[1]

    @property
    def mask(self) -> torch.Tensor:
        return self._data[2]

    def chunks(self, size: int) -> list[Rows]:
        return [Rows(*(t[start : start + size] for t in self._data)) for start in range(0, len(self.x), size)]


def _collate(items: list[tuple[torch.Tensor, ...]]) -> Rows:
    x, y, mask = (torch.stack(column) for column in zip(*items, strict=True))
    return Rows(x, y, mask)


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 1)
        self.seen: list[torch.Tensor] = []

    def forward(self, batch: Rows) -> torch.Tensor:
        self.seen.append(batch.x.detach().clone())
        return self.linear(batch.x).squeeze(-1)

    def loss(self, outputs: torch.Tensor, batch: Rows) -> torch.Tensor:
        return F.mse_loss(outputs, batch.y)


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(12, 3, generator=generator)
    mask = (torch.rand(12, 5, generator=generator) > 0.3).long()
    return TensorDataset(x, x.sum(dim=1), mask)


def _spec(**kwargs: Any) -> DataSpec:
    loader = DataLoader(_dataset(), batch_size=6, collate_fn=_collate)
    return DataSpec(
        loader,
        split_batch=lambda batch, size: batch.chunks(size),
        get_num_samples_in_batch=lambda batch: len(batch.x),
        **kwargs,
    )


def _trainer(model: nn.Module, spec: DataSpec, **kwargs: Any) -> Trainer:
    return Trainer(
        model=model,
        train_dataloader=spec,
        max_duration="2ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        progress_bar=False,
        accelerator="cpu",
        seed=0,
        **kwargs,
    )


def test_a_custom_batch_type_microbatches_to_the_full_batch_result_and_counts_samples_and_tokens() -> None:
    torch.manual_seed(0)
    whole, split = Regressor(), Regressor()
    split.load_state_dict(whole.state_dict())
    tokens = {"get_num_tokens_in_batch": lambda batch: int(batch.mask.sum())}
    first = _trainer(whole, _spec(**tokens))
    first.fit()
    second = _trainer(split, _spec(**tokens), device_train_microbatch_size=4)
    second.fit()

    assert [len(x) for x in split.seen] == [4, 2, 4, 2]  # 6-sample batches as 4 + 2
    for expected, actual in zip(whole.parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(actual, expected)
    timestamp = second.state.timestamp
    assert int(timestamp.sample) == 12
    assert int(timestamp.token) == int(_dataset().tensors[2].sum())  # the mask's ones, not every element


def test_tokens_come_from_the_spec_then_the_trainer_then_the_model() -> None:
    class Counting(Regressor):
        def get_num_tokens_in_batch(self, batch: Rows) -> int:
            return 100

    def run(spec_counter: Any = None, trainer_counter: Any = None) -> int:
        spec = _spec(get_num_tokens_in_batch=spec_counter)
        trainer = _trainer(Counting(), spec, get_num_tokens_in_batch=trainer_counter)
        trainer.fit()
        return int(trainer.state.timestamp.token)

    assert run() == 200
    assert run(trainer_counter=lambda batch: 10) == 20
    assert run(spec_counter=lambda batch: 1, trainer_counter=lambda batch: 10) == 2


def test_batch_transforms_run_before_device_transforms_in_train_eval_and_predict() -> None:
    calls: list[str] = []

    def on_cpu(batch: Rows) -> Rows:
        calls.append("batch")
        return Rows(batch.x * 2, batch.y, batch.mask)

    def on_device(batch: Rows) -> Rows:
        calls.append("device")
        return Rows(batch.x + 1, batch.y, batch.mask)

    model = Regressor()
    raw = torch.stack([item[0] for item in _dataset()])
    trainer = _trainer(model, _spec(batch_transforms=on_cpu, device_transforms=on_device))
    trainer.fit()
    assert calls == ["batch", "device"] * 2
    torch.testing.assert_close(torch.cat(model.seen), raw * 2 + 1)

    model.seen.clear()
    trainer.eval(Evaluator("spec", _spec(batch_transforms=on_cpu, device_transforms=on_device)))
    assert int(trainer.state.eval_timestamp.sample) == 12
    torch.testing.assert_close(torch.cat(model.seen), raw * 2 + 1)

    model.seen.clear()
    outputs = trainer.predict(_spec(device_transforms=on_device))
    assert len(outputs) == 2
    torch.testing.assert_close(torch.cat(model.seen), raw + 1)


def test_wrong_results_of_the_spec_functions_are_errors_naming_them() -> None:
    model = Regressor()
    bad_split = _trainer(
        model,
        DataSpec(
            _spec().dataloader, split_batch=lambda batch, size: batch, get_num_samples_in_batch=lambda b: len(b.x)
        ),
        device_train_microbatch_size=2,
    )
    with pytest.raises(TypeError, match="split_batch returned Rows"):
        bad_split.fit()
    bad_count = _trainer(copy.deepcopy(model), DataSpec(_spec().dataloader, get_num_samples_in_batch=lambda b: -1))
    with pytest.raises(TypeError, match=r"get_num_samples_in_batch returned -1"):
        bad_count.fit()
    with pytest.raises(TypeError, match=r"DataSpec\(split_batch=\.\.\.\) must be callable"):
        DataSpec([], split_batch=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="iterable of batches"):
        DataSpec(5)  # type: ignore[arg-type]


def test_without_a_spec_function_the_defaults_still_fail_loudly_on_unknown_batches() -> None:
    trainer = _trainer(Regressor(), DataSpec(_spec().dataloader))
    with pytest.raises(TypeError, match="Cannot tell the batch size of a Rows"):
        trainer.fit()


def test_callable_metrics_weigh_each_batch_by_the_samples_the_spec_counts() -> None:
    class WithMetric(Regressor):
        def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
            return {"target_mean": lambda outputs, batch: batch.y.mean()}

    loader = DataLoader(_dataset(), batch_size=8, collate_fn=_collate)  # batches of 8 and 4 samples
    spec = DataSpec(
        loader, split_batch=lambda batch, size: batch.chunks(size), get_num_samples_in_batch=lambda b: len(b.x)
    )
    trainer = _trainer(WithMetric(), _spec(), eval_dataloader=spec)
    metrics = trainer.eval()
    targets = _dataset().tensors[1]
    assert metrics["metrics/eval/target_mean"] == pytest.approx(float(targets.mean()))  # not the mean of batch means
    assert float(targets.mean()) != pytest.approx(float((targets[:8].mean() + targets[8:].mean()) / 2))


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"max_duration": "100tok"}, "max_duration (100tok) is in tokens"),
        ({"max_duration": "2ba", "eval_interval": "50tok"}, "eval eval_interval (every 50tok) is in tokens"),
        (
            {"max_duration": "2ba", "schedulers": LinearWithWarmupScheduler(t_warmup="100tok", t_max="900tok")},
            "LinearWithWarmupScheduler t_warmup='100tok', LinearWithWarmupScheduler t_max='900tok' are in tokens",
        ),
    ],
)
def test_a_time_in_tokens_with_no_tokens_counted_fails_at_the_first_batch(options: dict[str, Any], named: str) -> None:
    """Without a token counter the run would never end, or the evaluator never run: fail, naming the option."""
    model = Regressor()
    trainer = Trainer(
        model=model,
        train_dataloader=_spec(),
        eval_dataloader=_spec(),
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        progress_bar=False,
        accelerator="cpu",
        **options,
    )
    with pytest.raises(ValueError, match=re.escape(named) + r", but the first batch counted none"):
        trainer.fit()
    assert int(trainer.state.timestamp.batch) == 1


def test_a_time_in_tokens_counts_the_tokens_the_spec_gives() -> None:
    tokens = {"get_num_tokens_in_batch": lambda batch: int(batch.mask.sum())}
    model = Regressor()
    trainer = Trainer(
        model=model,
        train_dataloader=_spec(**tokens),
        max_duration="30tok",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        progress_bar=False,
        accelerator="cpu",
    )
    trainer.fit()
    assert int(trainer.state.timestamp.token) >= 30
    assert int(trainer.state.timestamp.token) - int(_dataset().tensors[2][-6:].sum()) < 30  # stopped at the mark
