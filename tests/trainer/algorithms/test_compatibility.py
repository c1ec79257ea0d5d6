"""Every algorithm of the registry, pairwise: declared incompatibilities are rejected, every other pair trains together.

Each compatible pair runs through the Trainer for 4 batches on a small residual conv net plus a token branch (an
embedding, a ``nn.TransformerEncoderLayer`` with dropout, a GroupNorm) whose batches are dicts holding images,
labels and token ids (so image, attention and sequence methods all find their inputs), from a dataset with a
torchvision-style ``transform`` (for AugMix and RandAugment), with the time-based methods set to act from the
first batches on. Pairs with a low-precision norm train under ``bf16-mixed``, where those act.
"""

from __future__ import annotations

import ast
import itertools
import math
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import fabric.trainer.algorithms as algorithms
from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.passes import check_compatibility

# Channels-last convolutions hit a native kernel that crashed on AVX2-only CPUs (torch 2.13): each test runs
# in a forked child, so a crash fails one test instead of aborting the suite (tests/isolation.py).
pytestmark = pytest.mark.isolated


def _factories(image_task: ModuleType) -> dict[str, Callable[[], Algorithm]]:
    """One way to build each algorithm, with settings that make it act within 4 batches of this task."""
    keys = {"input_key": "inputs", "target_key": "targets"}
    return {
        "Alibi": lambda: algorithms.Alibi(max_sequence_length=16, train_sequence_length_scaling=1.0),
        "AugMix": lambda: algorithms.AugMix(severity=3, width=2),
        "BlurPool": lambda: algorithms.BlurPool(min_channels=4),
        "ChannelsLast": lambda: algorithms.ChannelsLast(),
        "ColOut": lambda: algorithms.ColOut(input_key="inputs"),
        "CutMix": lambda: algorithms.CutMix(**keys),
        "CutOut": lambda: algorithms.CutOut(input_key="inputs"),
        "EMA": lambda: algorithms.EMA(half_life="1ba"),
        "Factorize": lambda: algorithms.Factorize(min_channels=4, latent_channels=0.5, min_features=4),
        "GatedLinearUnits": lambda: algorithms.GatedLinearUnits(act_fn="gelu"),
        "GhostBatchNorm": lambda: algorithms.GhostBatchNorm(ghost_batch_size=4),
        "GradientClipping": lambda: algorithms.GradientClipping("norm", 1.0),
        "GyroDropout": lambda: algorithms.GyroDropout(p=0.2, sigma=8, tau=2),
        "LabelSmoothing": lambda: algorithms.LabelSmoothing(target_key="targets"),
        "LayerFreezing": lambda: algorithms.LayerFreezing(freeze_start=0.25, freeze_level=0.5, interval="batch"),
        "LowPrecisionGroupNorm": lambda: algorithms.LowPrecisionGroupNorm(),
        "LowPrecisionLayerNorm": lambda: algorithms.LowPrecisionLayerNorm(),
        "MixUp": lambda: algorithms.MixUp(**keys),
        "ProgressiveResizing": lambda: algorithms.ProgressiveResizing(delay_fraction=0.0, **keys),
        "RandAugment": lambda: algorithms.RandAugment(severity=5, depth=2),
        "SAM": lambda: algorithms.SAM(),
        "SWA": lambda: algorithms.SWA(swa_start="1ba", swa_end="3ba", update_interval="1ba", anneal_steps=1),
        "SelectiveBackprop": lambda: algorithms.SelectiveBackprop(start=0.0, end=1.0, interrupt=0, **keys),
        "SeqLengthWarmup": lambda: algorithms.SeqLengthWarmup(duration=0.5, min_seq_length=4, max_seq_length=8),
        "SqueezeExcite": lambda: algorithms.SqueezeExcite(latent_channels=0.5, min_channels=4),
        "StochasticDepth": lambda: algorithms.StochasticDepth(image_task.ResidualBlock, "branch", drop_rate=0.5),
        "WeightStandardization": lambda: algorithms.WeightStandardization(n_last_layers_ignore=1),
    }


def test_every_algorithm_is_exported_and_has_a_factory_here(image_task: ModuleType) -> None:
    assert sorted(_factories(image_task)) == sorted(algorithms.__all__)
    assert algorithms.__all__ == list(algorithms.ALGORITHMS)
    for name, module in algorithms.ALGORITHMS.items():
        assert issubclass(getattr(algorithms, name), Algorithm)
        assert getattr(algorithms, name).__module__ == f"fabric.trainer.algorithms.{module}"


def test_type_checkers_see_exactly_the_registered_algorithms() -> None:
    """The ``TYPE_CHECKING`` imports of ``fabric.trainer.algorithms`` name each registered class from its module."""
    tree = ast.parse(Path(algorithms.__file__).read_text())
    guarded = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    imported = {
        alias.name: node.module for node in guarded.body if isinstance(node, ast.ImportFrom) for alias in node.names
    }
    assert imported == {name: f"fabric.trainer.algorithms.{module}" for name, module in algorithms.ALGORITHMS.items()}


def test_plain_functions_are_exported_and_nothing_loads_before_first_use() -> None:
    import fabric.trainer.functional as functional

    for name in functional.__all__:
        function = getattr(functional, name)
        assert callable(function) and function.__module__.startswith("fabric.trainer.algorithms."), name
    script = (
        "import sys, fabric.trainer.algorithms, fabric.trainer.functional\n"
        "print(sorted(m for m in sys.modules if m.startswith('fabric.trainer.algorithms.')))"
    )
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert loaded.stdout.strip() == "[]"


def _declared_clash(first: type[Algorithm], second: type[Algorithm]) -> type[Algorithm] | None:
    """The class that declares the pair incompatible (its docstring gives the reason), if either does."""
    if issubclass(second, first.incompatible_with):
        return first
    if issubclass(first, second.incompatible_with):
        return second
    return None


def _pairs() -> list[tuple[str, str]]:
    return list(itertools.combinations(sorted(algorithms.__all__), 2))


@pytest.fixture(scope="module")
def dict_batch_model(image_task: ModuleType) -> type[torch.nn.Module]:
    class DictBatchResNet(image_task.SmallResNet):  # type: ignore[name-defined, misc]
        """SmallResNet plus a token branch over ``{"inputs": images, "targets": labels, "input_ids": tokens}``."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.tokens = torch.nn.Embedding(50, 8)
            self.encoder = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True)
            self.token_norm = torch.nn.GroupNorm(2, 8)
            self.token_head = torch.nn.Linear(8, 10)

        def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
            images: torch.Tensor = self.net(batch["inputs"])
            tokens = self.token_norm(self.encoder(self.tokens(batch["input_ids"])).mean(dim=1))
            output: torch.Tensor = images + self.token_head(tokens)
            return output

        def loss(self, outputs: torch.Tensor, batch: Mapping[str, Any], reduction: str = "mean") -> torch.Tensor:
            return F.cross_entropy(outputs, batch["targets"], reduction=reduction)

    return DictBatchResNet


class _Samples(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, image_task: ModuleType, count: int) -> None:
        self.images, self.labels = image_task.synthetic_patterns(count, seed=3).tensors
        self.tokens = torch.randint(0, 50, (count, 16), generator=torch.Generator().manual_seed(3))
        #: Applied to each image, mapped into [0, 1] and back (the images are roughly standard normal).
        self.transform: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        image = self.images[index]
        if self.transform is not None:
            image = (self.transform((image * 0.25 + 0.5).clamp(0, 1)) - 0.5) * 4
        return {"inputs": image, "targets": self.labels[index], "input_ids": self.tokens[index]}


@pytest.mark.parametrize(("first", "second"), _pairs(), ids=["+".join(pair) for pair in _pairs()])
def test_each_pair_is_rejected_with_its_reason_or_trains_together(
    first: str,
    second: str,
    image_task: ModuleType,
    dict_batch_model: type[torch.nn.Module],
    one_thread: None,
) -> None:
    factories = _factories(image_task)
    pair = [factories[first](), factories[second]()]
    declaring = _declared_clash(type(pair[0]), type(pair[1]))
    if declaring is not None:
        other = type(pair[1]) if declaring is type(pair[0]) else type(pair[0])
        with pytest.raises(
            ValueError, match=f"{declaring.__name__} cannot run together with {other.__name__}: "
        ) as error:
            check_compatibility(pair)
        assert declaring.incompatibility_reason and declaring.incompatibility_reason in str(error.value)
        return

    from fabric.trainer.trainer import Trainer

    torch.manual_seed(0)
    model = dict_batch_model(width=4)
    low_precision = {"LowPrecisionGroupNorm", "LowPrecisionLayerNorm"} & {first, second}
    trainer = Trainer(
        model,
        DataLoader(_Samples(image_task, 32), batch_size=8),
        max_duration="4ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
        algorithms=pair,
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed" if low_precision else "32-true",
        progress_bar=False,
        seed=0,
    )
    trainer.fit()
    assert int(trainer.state.timestamp.batch) == 4
    assert math.isfinite(float(trainer.state.loss))
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())
    trainer.close()
