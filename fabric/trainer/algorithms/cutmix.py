"""CutMix: paste a random box from another sample of the batch into each image, and mix the labels by area.

A box covering about ``1 - lam`` of the image (``lam ~ Beta(alpha, alpha)``) is cut at one random place,
the same for the whole batch, and filled with the same region of each sample's permuted partner. The
targets become ``(1 - mixing) * y + mixing * y[perm]`` where ``mixing`` is the box's exact share of the
image after clipping at the borders. From "CutMix: Regularization Strategy to Train Strong Classifiers with
Localizable Features" (Yun et al., ICCV 2019).

Events: as MixUp (:class:`~fabric.trainer.algorithms.mixup.MixingAlgorithm`): inputs at ``BEFORE_FORWARD``,
targets at ``BEFORE_LOSS``, originals restored at ``AFTER_LOSS``. Inputs are ``(N, C, H, W)`` (or any
``(N, ..., H, W)``).
"""

from __future__ import annotations

import math

import torch
from typing_extensions import override

from fabric.trainer.algorithms.batch import BatchKey
from fabric.trainer.algorithms.mixup import MixingAlgorithm, check_alpha, random_permutation, sample_mixing


def cutmix_box(
    height: int, width: int, kept_fraction: float, generator: torch.Generator | None = None
) -> tuple[int, int, int, int]:
    """``(top, bottom, left, right)`` of a box of about ``1 - kept_fraction`` of the area, centred at random and
    clipped to the image."""
    cut_height = int(height * math.sqrt(1.0 - kept_fraction))
    cut_width = int(width * math.sqrt(1.0 - kept_fraction))
    center_y = int(torch.randint(0, height, (1,), generator=generator).item())
    center_x = int(torch.randint(0, width, (1,), generator=generator).item())
    top, bottom = max(center_y - cut_height // 2, 0), min(center_y + cut_height - cut_height // 2, height)
    left, right = max(center_x - cut_width // 2, 0), min(center_x + cut_width - cut_width // 2, width)
    return top, bottom, left, right


def cutmix_batch(
    inputs: torch.Tensor, targets: torch.Tensor, alpha: float = 1.0, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """CutMix a batch for a custom loop: returns ``(mixed_inputs, permuted_targets, mixing)``, where ``mixing``
    is the share of each image taken from its partner; train with
    ``(1 - mixing) * loss(out, targets) + mixing * loss(out, permuted_targets)``."""
    mixed, permutation, mixing = _cutmix(inputs, check_alpha("cutmix_batch", alpha), generator)
    return mixed, targets[permutation], mixing


def _cutmix(
    inputs: torch.Tensor, alpha: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    if inputs.ndim < 3:
        raise ValueError(f"CutMix needs images shaped (N, ..., H, W), got a tensor of shape {tuple(inputs.shape)}.")
    height, width = inputs.shape[-2:]
    top, bottom, left, right = cutmix_box(height, width, sample_mixing(alpha, generator), generator)
    permutation = random_permutation(inputs.shape[0], inputs.device, generator)
    mixed = inputs.clone()
    mixed[..., top:bottom, left:right] = inputs[permutation][..., top:bottom, left:right]
    return mixed, permutation, (bottom - top) * (right - left) / (height * width)


class CutMix(MixingAlgorithm):
    """CutMix (see the module docstring). ``alpha`` is the Beta concentration of the kept area; ``num_classes``,
    if given, is checked against the outputs' dimension 1."""

    def __init__(
        self, alpha: float = 1.0, input_key: BatchKey = 0, target_key: BatchKey = 1, *, num_classes: int | None = None
    ) -> None:
        super().__init__(alpha, False, input_key, target_key, num_classes)

    @override
    def mix(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        return _cutmix(inputs, self.alpha, None)
