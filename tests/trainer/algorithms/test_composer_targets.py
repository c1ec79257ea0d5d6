"""Algorithms as Composer users expect (issue 13, item 6): one-hot integer targets, MixUp(num_classes=...),
SelectiveBackprop's interrupt counted within the epoch, ColOut on segmentation masks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric.trainer.algorithms.colout import ColOut
from fabric.trainer.algorithms.cutmix import CutMix
from fabric.trainer.algorithms.label_smoothing import LabelSmoothing, smooth_labels
from fabric.trainer.algorithms.mixup import MixUp, mix_targets
from fabric.trainer.algorithms.selective_backprop import SelectiveBackprop
from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.callback import Callback
from fabric.trainer.core.state import State
from fabric.trainer.trainer import Trainer


class TargetShapes(nn.Module):
    """A linear classifier over flattened inputs that records the shape of the targets its loss receives."""

    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, classes)
        self.target_shapes: list[tuple[int, ...]] = []

    def forward(self, batch: Any) -> torch.Tensor:
        return self.linear(batch[0].flatten(1))  # type: ignore[no-any-return]

    def loss(self, outputs: torch.Tensor, batch: Any, reduction: str = "mean") -> torch.Tensor:
        targets = batch[1]
        self.target_shapes.append(tuple(targets.shape))
        return F.cross_entropy(
            outputs, targets.float() if targets.ndim == outputs.ndim else targets, reduction=reduction
        )


def _train(
    model: nn.Module, data: TensorDataset, algorithms: list[Algorithm], batch_size: int = 4, **options: Any
) -> None:
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(data, batch_size=batch_size),
        max_duration=options.pop("max_duration", "1ep"),
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        algorithms=algorithms,
        progress_bar=False,
        seed=0,
        accelerator="cpu",
        **options,
    )
    trainer.fit()


def _images(samples: int = 8, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(samples, 3, 4, 4, generator=generator), torch.randint(
        0, classes, (samples,), generator=generator
    )


@pytest.mark.parametrize(
    "algorithm",
    [LabelSmoothing(0.1), MixUp(num_classes=10, alpha=0.1), CutMix(num_classes=10, alpha=1.0)],
    ids=["LabelSmoothing", "MixUp", "CutMix"],
)
def test_integer_one_hot_targets_stay_n_by_c(algorithm: Algorithm) -> None:
    inputs, labels = _images()
    model = TargetShapes(48, 10)
    _train(model, TensorDataset(inputs, F.one_hot(labels, 10)), [algorithm])
    assert model.target_shapes == [(4, 10), (4, 10)]


def test_one_hot_and_index_targets_give_the_same_probabilities() -> None:
    logits, labels = torch.randn(6, 5), torch.tensor([0, 4, 2, 2, 1, 3])
    one_hot = F.one_hot(labels, 5)
    torch.testing.assert_close(smooth_labels(logits, one_hot, 0.2), smooth_labels(logits, labels, 0.2))
    permutation = torch.tensor([5, 4, 3, 2, 1, 0])
    torch.testing.assert_close(
        mix_targets(one_hot, permutation, 0.3, logits), mix_targets(labels, permutation, 0.3, logits)
    )
    with pytest.raises(ValueError, match=r"have 4 classes along dim 1, but the outputs of shape \(6, 5\) have 5"):
        smooth_labels(logits, F.one_hot(labels.clamp(max=3), 4), 0.1)


def test_seed_mixup_with_num_classes_trains_and_checks_the_outputs() -> None:
    inputs, labels = _images()
    model = TargetShapes(48, 10)
    _train(model, TensorDataset(inputs, labels), [MixUp(num_classes=10, alpha=0.1)])
    assert model.target_shapes == [(4, 10), (4, 10)]  # indices became mixed one-hot rows of 10 classes
    with pytest.raises(ValueError, match=r"MixUp\(num_classes=10\) got outputs of shape \(4, 7\)"):
        _train(TargetShapes(48, 7), TensorDataset(inputs, labels), [MixUp(num_classes=10, alpha=0.1)])
    with pytest.raises(ValueError, match=r"num_classes=1\.5 must be an int >= 2"):
        MixUp(num_classes=1.5)  # type: ignore[arg-type]


def test_selective_backprop_alternates_within_each_epoch() -> None:
    class ForwardSizes(Callback):
        def __init__(self) -> None:
            self.sizes: list[int] = []

        def before_forward(self, state: State, logger: Any) -> None:
            self.sizes.append(int(state.batch[0].shape[0]))

    inputs, labels = _images(samples=12)
    sizes = ForwardSizes()
    algorithm = SelectiveBackprop(start=0.0, end=1.0, keep=0.5)  # Composer's default interrupt=2
    _train(TargetShapes(48, 10), TensorDataset(inputs, labels), [algorithm], max_duration="2ep", callbacks=sizes)
    # 3 batches per epoch: selective, full, selective in each epoch (the count restarts with the epoch).
    assert sizes.sizes == [2, 4, 2, 2, 4, 2]


@pytest.mark.parametrize("batch", [True, False])
def test_colout_drops_the_same_rows_and_columns_from_a_segmentation_mask(batch: bool) -> None:
    height = width = 8
    position = torch.arange(height * width).view(height, width)
    images = position.float().expand(4, 3, height, width).clone()  # every pixel holds its own position
    masks = position.expand(4, height, width).clone()

    class Check(Callback):
        def __init__(self) -> None:
            self.checked = 0

        def before_forward(self, state: State, logger: Any) -> None:
            image, mask = state.batch
            assert image.shape[-2:] == (6, 6) and mask.shape == (image.shape[0], 6, 6)
            torch.testing.assert_close(image[:, 0], mask.float())
            self.checked += 1

    class Segmenter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 64, 1)

        def forward(self, batch: Any) -> torch.Tensor:
            return self.conv(batch[0])  # type: ignore[no-any-return]

        def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
            return F.cross_entropy(outputs, batch[1])

    check = Check()
    colout = ColOut(p_row=0.25, p_col=0.25, batch=batch)
    _train(Segmenter(), TensorDataset(images, masks), [colout], batch_size=2, callbacks=check)
    assert check.checked == 2


def test_colout_leaves_class_targets_alone_and_refuses_a_forced_resize_of_them() -> None:
    images, labels = _images()
    model = TargetShapes(27, 10)  # 3 x 3 x 3 after ColOut of a third of 4 rows and columns
    _train(model, TensorDataset(images, labels), [ColOut(p_row=0.3, p_col=0.3)])
    assert model.target_shapes == [(4,), (4,)]
    with pytest.raises(ValueError, match=r"a target of shape \(4,\) is not a mask"):
        _train(TargetShapes(27, 10), TensorDataset(images, labels), [ColOut(p_row=0.3, p_col=0.3, resize_target=True)])
