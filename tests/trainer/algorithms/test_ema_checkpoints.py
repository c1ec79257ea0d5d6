"""EMA and Trainer checkpoints: a full checkpoint holds the raw weights and the average and resumes bit-exactly; a
weights-only checkpoint (the model to deploy) holds the average, and writing it leaves training untouched."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric.trainer.algorithms.ema import EMA
from fabric.trainer.core.callback import Callback
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time
from fabric.trainer.trainer import Trainer

Batch = tuple[torch.Tensor, torch.Tensor]
MAX_BATCHES = 10


class Classifier(nn.Module):
    """BatchNorm buffers (averaged, and an integer counter copied) and dropout (needs the RNG restored)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.net(batch[0])  # type: ignore[no-any-return]

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(outputs, batch[1])


class StopAt(Callback):
    def __init__(self, batch: int) -> None:
        self.batch = batch

    def batch_end(self, state: State, logger: Any) -> None:
        if int(state.timestamp.batch) == self.batch:
            state.stop_training()


def _data() -> TensorDataset:
    x = torch.randn(48, 8, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def _trainer(initial: nn.Module, **kwargs: Any) -> Trainer:
    """6 batches an epoch, evaluated every 3 batches (EMA swaps the average in and out), Adam, EMA half-life 2."""
    model = copy.deepcopy(initial)
    options: dict[str, Any] = {
        "train_dataloader": DataLoader(_data(), batch_size=8, shuffle=True),
        "eval_dataloader": DataLoader(_data(), batch_size=16),
        "eval_interval": "3ba",
        "max_duration": f"{MAX_BATCHES}ba",
        "optimizers": torch.optim.Adam(model.parameters(), lr=0.01),
        "algorithms": [EMA(half_life="2ba")],
        "progress_bar": False,
        "seed": 7,
        "accelerator": "cpu",
    }
    options.update(kwargs)
    return Trainer(model=model, **options)


def _ema(trainer: Trainer) -> EMA:
    (ema,) = trainer.state.algorithms
    assert isinstance(ema, EMA)
    return ema


def _module(trainer: Trainer) -> nn.Module:
    """The user's model inside the Trainer's wrapper."""
    module = trainer.state.model.module
    assert isinstance(module, nn.Module)
    return module


def _named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters then buffers by name, in the order EMA keeps its averages."""
    return {name: t.detach().clone() for name, t in [*module.named_parameters(), *module.named_buffers()]}


def _averages_by_name(trainer: Trainer) -> dict[str, torch.Tensor]:
    averages = _ema(trainer).averages
    assert averages is not None
    names = _named_tensors(_module(trainer))
    return dict(zip(names, averages, strict=True))


@pytest.fixture(scope="module")
def initial() -> nn.Module:
    torch.manual_seed(0)
    return Classifier()


@pytest.fixture(scope="module")
def uninterrupted(initial: nn.Module, tmp_path_factory: pytest.TempPathFactory) -> tuple[Trainer, Path]:
    """A straight run to MAX_BATCHES that also writes a weights-only checkpoint at the end (through the saver)."""
    folder = tmp_path_factory.mktemp("weights_only")
    trainer = _trainer(initial, save_folder=str(folder), save_interval=f"{MAX_BATCHES}ba", save_weights_only=True)
    trainer.fit()
    trainer.close()
    return trainer, folder / f"ep1-ba{MAX_BATCHES}-rank0.pt"


@pytest.mark.parametrize("stop_at", [3, 9])  # mid-epoch 1 and 2, where the straight run evaluates too
def test_a_full_checkpoint_with_ema_resumes_bit_exactly(
    tmp_path: Path, initial: nn.Module, uninterrupted: tuple[Trainer, Path], stop_at: int
) -> None:
    first = _trainer(initial, callbacks=[StopAt(stop_at)])
    first.fit()
    raw = _named_tensors(_module(first))
    first.save_checkpoint(str(tmp_path / "full.pt"))
    saved = torch.load(tmp_path / "full.pt", weights_only=True)
    for name, tensor in saved["model"].items():  # the raw weights, not the average
        assert torch.equal(tensor, raw[name]), name
    assert not torch.equal(saved["model"]["net.0.weight"], _averages_by_name(first)["net.0.weight"])

    torch.manual_seed(12345)  # as a new process would: whatever RNG state it happens to have
    resumed = _trainer(initial, load_path=str(tmp_path / "full.pt"))
    assert int(resumed.state.timestamp.batch) == stop_at
    resumed.fit()
    straight = uninterrupted[0]
    for name, tensor in _named_tensors(_module(straight)).items():
        assert torch.equal(_named_tensors(_module(resumed))[name], tensor), f"raw {name}"
    for name, average in _averages_by_name(straight).items():
        assert torch.equal(_averages_by_name(resumed)[name], average), f"average {name}"


def test_a_weights_only_checkpoint_holds_the_average(uninterrupted: tuple[Trainer, Path], initial: nn.Module) -> None:
    trainer, saved_by_the_saver = uninterrupted
    averages = _averages_by_name(trainer)
    weights = torch.load(saved_by_the_saver, weights_only=True)["model"]
    assert set(weights) == set(averages)
    for name, average in averages.items():
        assert torch.equal(weights[name], average), name
    assert not torch.equal(averages["net.0.weight"], _named_tensors(_module(trainer))["net.0.weight"])

    deployed = _trainer(initial, load_path=str(saved_by_the_saver), load_weights_only=True)
    for name, tensor in _named_tensors(_module(deployed)).items():
        assert torch.equal(tensor, averages[name]), name


def test_save_checkpoint_weights_only_exports_the_average_and_keeps_training_on_the_raw_weights(
    tmp_path: Path, initial: nn.Module
) -> None:
    trainer = _trainer(initial, max_duration="3ba", eval_dataloader=None)
    trainer.fit()
    raw, averages = _named_tensors(_module(trainer)), _averages_by_name(trainer)
    trainer.save_checkpoint(str(tmp_path / "weights.pt"), weights_only=True)
    exported = torch.load(tmp_path / "weights.pt", weights_only=True)["model"]
    assert all(torch.equal(exported[name], average) for name, average in averages.items())
    after = _named_tensors(_module(trainer))
    assert all(torch.equal(after[name], tensor) for name, tensor in raw.items())  # swapped back exactly
    assert all(torch.equal(_averages_by_name(trainer)[name], a) for name, a in averages.items())


def test_before_ema_starts_a_weights_only_export_holds_the_raw_weights() -> None:
    model, ema = Classifier(), EMA(half_life="2ba", ema_start="5ba")
    state = State(model=model, max_duration=Time.from_timestring("10ba"))
    raw = _named_tensors(model)
    with ema.exported_weights(state):
        assert all(torch.equal(tensor, raw[name]) for name, tensor in _named_tensors(model).items())
