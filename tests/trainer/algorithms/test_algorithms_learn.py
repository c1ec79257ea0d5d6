"""Every data/loss/optimisation method leaves a tiny model able to learn, trained by the real Trainer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fabric.trainer.algorithms.colout import ColOut
from fabric.trainer.algorithms.cutmix import CutMix
from fabric.trainer.algorithms.cutout import CutOut
from fabric.trainer.algorithms.ema import EMA
from fabric.trainer.algorithms.gradient_clipping import GradientClipping
from fabric.trainer.algorithms.label_smoothing import LabelSmoothing
from fabric.trainer.algorithms.layer_freezing import LayerFreezing
from fabric.trainer.algorithms.mixup import MixUp
from fabric.trainer.algorithms.progressive_resizing import ProgressiveResizing
from fabric.trainer.algorithms.sam import SAM
from fabric.trainer.algorithms.selective_backprop import SelectiveBackprop
from fabric.trainer.algorithms.seq_length_warmup import SeqLengthWarmup
from fabric.trainer.algorithms.swa import SWA
from fabric.trainer.core.algorithm import Algorithm

IMAGE_METHODS: dict[str, Callable[[], list[Algorithm]]] = {
    "LayerFreezing": lambda: [LayerFreezing(freeze_start=0.5, freeze_level=1.0)],
    "MixUp": lambda: [MixUp(alpha=0.2)],
    "MixUp+interpolate_loss": lambda: [MixUp(alpha=0.2, interpolate_loss=True)],
    "CutMix": lambda: [CutMix(alpha=1.0)],
    "CutOut": lambda: [CutOut(num_holes=1, length=0.5)],
    "ColOut": lambda: [ColOut(p_row=0.15, p_col=0.15, batch=False)],
    "LabelSmoothing": lambda: [LabelSmoothing(smoothing=0.1)],
    "MixUp+LabelSmoothing": lambda: [MixUp(alpha=0.2), LabelSmoothing(smoothing=0.1)],
    "GradientClipping-norm": lambda: [GradientClipping("norm", 1.0)],
    "GradientClipping-value": lambda: [GradientClipping("value", 0.5)],
    "GradientClipping-adaptive": lambda: [GradientClipping("adaptive", 0.1)],
    "EMA": lambda: [EMA(half_life="5ba")],
    "SWA": lambda: [SWA(swa_start="0.5dur", swa_end="1.0dur", swa_lr=0.01, update_interval="1ep")],
    "SAM": lambda: [SAM(rho=0.05)],
    "ProgressiveResizing": lambda: [ProgressiveResizing(initial_scale=0.5, size_increment=2)],
    "SelectiveBackprop": lambda: [SelectiveBackprop(start=0.0, end=1.0, keep=0.5)],
}


@pytest.mark.parametrize("name", list(IMAGE_METHODS))
def test_a_tiny_image_classifier_still_learns(name: str, learn_images: Callable[..., tuple[float, float]]) -> None:
    before, after = learn_images(IMAGE_METHODS[name]())
    assert after < 0.5 * before, f"{name}: loss {before:.3f} -> {after:.3f}"


def test_sam_learns_with_microbatches(learn_images: Callable[..., tuple[float, float]]) -> None:
    before, after = learn_images([SAM(rho=0.05)], device_train_microbatch_size=8)
    assert after < 0.5 * before


class NextToken(nn.Module):
    """Predicts token ``t + 1 (mod vocab)`` from token ``t``; batches are ``{"input_ids", "labels"}``."""

    def __init__(self, vocab: int = 16) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, 16), nn.Linear(16, vocab)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.head(self.embed(batch["input_ids"]))

    def loss(self, outputs: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        return F.cross_entropy(outputs.flatten(0, 1), batch["labels"].flatten())


class TokenDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": (self.tokens[index] + 1) % 16}


@pytest.mark.parametrize("truncate", [True, False])
def test_a_tiny_language_model_still_learns_with_seq_length_warmup(truncate: bool) -> None:
    from fabric.trainer.trainer import Trainer

    torch.manual_seed(0)
    tokens = torch.randint(0, 16, (64, 32))
    model = NextToken()
    full = TokenDataset(tokens)[list(range(64))]  # type: ignore[index]
    with torch.no_grad():
        before = model.loss(model(full), full).item()
    loader = torch.utils.data.DataLoader(TokenDataset(tokens), batch_size=16)
    trainer = Trainer(
        model=model,
        train_dataloader=loader,
        max_duration="10ep",
        optimizers=torch.optim.Adam(model.parameters(), lr=0.05),
        algorithms=[SeqLengthWarmup(duration=0.5, min_seq_length=4, max_seq_length=32, step_size=4, truncate=truncate)],
        progress_bar=False,
        seed=0,
        accelerator="cpu",
    )
    trainer.fit()
    trainer.close()
    with torch.no_grad():
        after = model.loss(model(full), full).item()
    assert after < 0.5 * before
