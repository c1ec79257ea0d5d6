"""RandAugment: each training image goes through ``depth`` operations drawn at random, each at a random strength.

Cubuk et al., "RandAugment: Practical automated data augmentation with a reduced search space" (2020), with
Composer's arguments: ``depth`` operations are drawn uniformly (with replacement) from ``augmentation_set``
(``"all"``, ``"safe"`` or ``"original"``, see :mod:`~fabric.trainer.algorithms.augmentation_primitives`) and
each draws its strength up to ``severity`` (0 to 10).

The algorithm fires once, at ``Event.FIT_START``, as Composer's does: it adds a :class:`RandAugmentTransform`
after the ``transform`` of the train dataloader's dataset (torchvision's convention: a callable applied to
each image in ``__getitem__``), so the augmentation runs per sample, in the dataloader workers. Images are
float tensors ``(C, H, W)`` in ``[0, 1]``, ``uint8`` tensors, or PIL images when Pillow is installed: the
dataset's transform must not normalise before it (add the normalisation to the model or after). A dataset
without a ``transform`` attribute is refused. Randomness comes from torch's global generator (seeded per
dataloader worker), or from a ``generator`` given to :func:`randaugment_image`.
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


def _check_depth(depth: int) -> int:
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"RandAugment: depth={depth!r} must be a non-negative integer (operations per image).")
    return depth


def randaugment_image(
    image: Any,
    severity: float = 9,
    depth: int = 2,
    augmentation_set: str | Sequence[Augmentation] = "all",
    generator: torch.Generator | None = None,
) -> Any:
    """``image`` after ``depth`` random operations of ``augmentation_set`` (see the module docstring).

    ``image``: a float tensor ``(C, H, W)`` in ``[0, 1]``, a ``uint8`` tensor or a PIL image; the result has its type.
    """
    check_severity("RandAugment", severity)
    _check_depth(depth)
    operations = resolve_augmentation_set("RandAugment", augmentation_set)
    tensor, back = as_float_image("RandAugment", image)
    for _ in range(depth):
        tensor = choose(operations, generator)(tensor, severity, generator)
    return back(tensor)


class RandAugmentTransform:
    """:func:`randaugment_image` as a dataset transform (picklable, for dataloader workers)."""

    def __init__(self, severity: float = 9, depth: int = 2, augmentation_set: str = "all") -> None:
        self.severity = check_severity("RandAugment", severity)
        self.depth = _check_depth(depth)
        self.augmentation_set = check_augmentation_set("RandAugment", augmentation_set)

    def __call__(self, image: Any) -> Any:
        return randaugment_image(image, self.severity, self.depth, self.augmentation_set)

    def __repr__(self) -> str:
        return f"RandAugmentTransform(severity={self.severity}, depth={self.depth}, set={self.augmentation_set!r})"


class RandAugment(Algorithm):
    """RandAugment on the train dataset's images (see the module docstring)."""

    def __init__(self, severity: float = 9, depth: int = 2, augmentation_set: str = "all") -> None:
        self.transform = RandAugmentTransform(severity, depth, augmentation_set)
        self.severity, self.depth, self.augmentation_set = severity, depth, augmentation_set

    @override
    def match(self, event: Event, state: State) -> bool:
        return event is Event.FIT_START

    @override
    def apply(self, event: Event, state: State, logger: Logger) -> None:
        add_dataset_transform("RandAugment", state, self.transform)

    def __repr__(self) -> str:
        return f"RandAugment(severity={self.severity}, depth={self.depth}, augmentation_set={self.augmentation_set!r})"
