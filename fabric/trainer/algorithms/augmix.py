"""AugMix: each training image becomes a blend of itself and a mix of randomly augmented copies.

Hendrycks et al., "AugMix: A Simple Data Processing Method to Improve Robustness and Uncertainty" (ICLR 2020),
with Composer's arguments. ``width`` chains each apply ``depth`` operations drawn uniformly from
``augmentation_set`` (``depth=-1``: 1 to 3, drawn per chain), each at a random strength up to ``severity``
(0 to 10; see :mod:`~fabric.trainer.algorithms.augmentation_primitives` for the operations and sets). The
chains are mixed with weights ``w ~ Dirichlet(alpha, ..., alpha)``, and the result is
``(1 - m) * image + m * mix`` with ``m ~ Beta(alpha, alpha)``. (The paper's Jensen-Shannon consistency loss is
not part of it, as in Composer.)

The algorithm fires once, at ``Event.FIT_START``, as Composer's does: it adds an :class:`AugmentAndMixTransform`
after the ``transform`` of the train dataloader's dataset (torchvision's convention: a callable applied to
each image in ``__getitem__``), so the augmentation runs per sample, in the dataloader workers. Images are
float tensors ``(C, H, W)`` in ``[0, 1]``, ``uint8`` tensors, or PIL images when Pillow is installed; the
dataset's transform must not normalise before it. A dataset without a ``transform`` attribute is refused.
Randomness comes from torch's global generator (seeded per dataloader worker), or from a ``generator``
given to :func:`augmix_image`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from typing_extensions import override

from fabric.trainer.algorithms.augmentation_primitives import (
    Augmentation,
    add_dataset_transform,
    as_float_image,
    check_augmentation_set,
    check_severity,
    choose,
    resolve_augmentation_set,
)
from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State


def _check(depth: int, width: int, alpha: float) -> None:
    if isinstance(depth, bool) or not isinstance(depth, int) or not (depth == -1 or depth >= 1):
        raise ValueError(f"AugMix: depth={depth!r} must be -1 (1 to 3 at random) or a positive integer.")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"AugMix: width={width!r} must be a positive integer (augmentation chains).")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha < float("inf"):
        raise ValueError(f"AugMix: alpha={alpha!r} must be a positive number (Dirichlet and Beta parameter).")


def mixing_weights(width: int, alpha: float, generator: torch.Generator | None = None) -> tuple[torch.Tensor, float]:
    """The chain weights ``~ Dirichlet(alpha * ones(width))`` and the blend ``m ~ Beta(alpha, alpha)``."""
    gammas = torch._standard_gamma(torch.full((width + 2,), float(alpha), dtype=torch.float64), generator=generator)
    chains = gammas[:width]
    total = chains.sum()
    weights = chains / total if total > 0 else torch.full((width,), 1.0 / width, dtype=torch.float64)
    pair = gammas[width:]
    blend = float(pair[0] / pair.sum()) if pair.sum() > 0 else 0.5
    return weights.float(), blend


def augmix_image(
    image: Any,
    severity: float = 3,
    depth: int = -1,
    width: int = 3,
    alpha: float = 1.0,
    augmentation_set: str | Sequence[Augmentation] = "all",
    generator: torch.Generator | None = None,
) -> Any:
    """``image`` blended with a mix of ``width`` randomly augmented copies (see the module docstring).

    ``image``: a float tensor ``(C, H, W)`` in ``[0, 1]``, a ``uint8`` tensor or a PIL image; the result has its type.
    """
    check_severity("AugMix", severity)
    _check(depth, width, alpha)
    operations = resolve_augmentation_set("AugMix", augmentation_set)
    tensor, back = as_float_image("AugMix", image)
    weights, blend = mixing_weights(width, alpha, generator)
    mix = torch.zeros_like(tensor)
    for weight in weights.tolist():
        chain_depth = depth if depth > 0 else int(torch.randint(1, 4, (), generator=generator))
        augmented = tensor
        for _ in range(chain_depth):
            augmented = choose(operations, generator)(augmented, severity, generator)
        mix += weight * augmented
    return back(((1 - blend) * tensor + blend * mix).clamp(0, 1))


class AugmentAndMixTransform:
    """:func:`augmix_image` as a dataset transform (picklable, for dataloader workers)."""

    def __init__(
        self, severity: float = 3, depth: int = -1, width: int = 3, alpha: float = 1.0, augmentation_set: str = "all"
    ) -> None:
        self.severity = check_severity("AugMix", severity)
        _check(depth, width, alpha)
        self.depth, self.width, self.alpha = depth, width, alpha
        self.augmentation_set = check_augmentation_set("AugMix", augmentation_set)

    def __call__(self, image: Any) -> Any:
        return augmix_image(image, self.severity, self.depth, self.width, self.alpha, self.augmentation_set)

    def __repr__(self) -> str:
        return (
            f"AugmentAndMixTransform(severity={self.severity}, depth={self.depth}, width={self.width}, "
            f"alpha={self.alpha}, augmentation_set={self.augmentation_set!r})"
        )


class AugMix(Algorithm):
    """AugMix on the train dataset's images (see the module docstring)."""

    def __init__(
        self, severity: float = 3, depth: int = -1, width: int = 3, alpha: float = 1.0, augmentation_set: str = "all"
    ) -> None:
        self.transform = AugmentAndMixTransform(severity, depth, width, alpha, augmentation_set)

    @override
    def match(self, event: Event, state: State) -> bool:
        return event is Event.FIT_START

    @override
    def apply(self, event: Event, state: State, logger: Logger) -> None:
        add_dataset_transform("AugMix", state, self.transform)

    def __repr__(self) -> str:
        return repr(self.transform).replace("AugmentAndMixTransform", "AugMix", 1)
