"""MixUp: train on convex combinations of pairs of samples and of their labels.

Each batch is paired with a random permutation of itself; inputs become ``(1 - mixing) * x + mixing * x[perm]``
and targets the same combination of the one-hot labels, with ``mixing ~ Beta(alpha, alpha)`` drawn once per
batch. From "mixup: Beyond Empirical Risk Minimization" (Zhang et al., ICLR 2018).

Events: the inputs are mixed at ``BEFORE_FORWARD``; the targets at ``BEFORE_LOSS`` (as soft labels, the number
of classes read from the outputs' dimension 1), or, with ``interpolate_loss=True``, the loss itself becomes
``(1 - mixing) * loss(y) + mixing * loss(y[perm])`` at ``AFTER_LOSS``, for losses that only take class indices.
The original inputs and targets are put back at ``AFTER_LOSS``, so metrics and later events see the real batch.

:class:`MixingAlgorithm` holds the event logic MixUp and CutMix share; they differ only in how inputs are mixed.
"""

from __future__ import annotations

import math
import random
from abc import abstractmethod
from typing import Any

import torch
import torch.nn.functional as F
from typing_extensions import override

from fabric.trainer.algorithms.batch import BatchKey, check_batch_key, get_batch_item, set_batch_item
from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State


def check_alpha(owner: str, alpha: float) -> float:
    """``alpha`` as a float if it is a valid Beta concentration (finite and positive)."""
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"{owner}: alpha={alpha!r} must be a finite number greater than 0.")
    return float(alpha)


def sample_mixing(alpha: float, generator: torch.Generator | None = None) -> float:
    """A draw from ``Beta(alpha, alpha)``, reproducible from ``generator`` (or torch's global RNG)."""
    seed = int(torch.randint(0, 2**62, (1,), generator=generator).item())
    return random.Random(seed).betavariate(alpha, alpha)


def random_permutation(size: int, device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """A random order of ``range(size)`` on ``device``, drawn from ``generator`` (a CPU generator) or the global RNG."""
    return torch.randperm(size, generator=generator).to(device)


def mix_targets(targets: torch.Tensor, permutation: torch.Tensor, mixing: float, outputs: torch.Tensor) -> torch.Tensor:
    """Soft targets ``(1 - mixing) * t + mixing * t[permutation]``, in the probabilities of :func:`to_probabilities`."""
    soft = to_probabilities(targets, outputs)
    return (1.0 - mixing) * soft + mixing * soft[permutation]


def to_probabilities(targets: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """``targets`` as probabilities over the classes of ``outputs`` (along dim 1, as ``cross_entropy`` expects).

    As Composer's ``ensure_targets_one_hot``: targets with one dimension fewer than ``outputs`` are class indices
    and become one-hot; targets shaped like ``outputs`` are probabilities already (soft labels, or the integer
    one-hot rows of ``F.one_hot``), returned as floats.
    """
    if targets.ndim == outputs.ndim:
        if targets.shape[1] != outputs.shape[1]:
            raise ValueError(
                f"Targets of shape {tuple(targets.shape)} have {targets.shape[1]} classes along dim 1, but the "
                f"outputs of shape {tuple(outputs.shape)} have {outputs.shape[1]}."
            )
        return targets if targets.is_floating_point() else targets.float()
    if targets.is_floating_point():
        return targets
    return F.one_hot(targets.long(), int(outputs.shape[1])).movedim(-1, 1).float()


def check_num_classes(owner: str, num_classes: int | None) -> int | None:
    if num_classes is not None and (
        isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2
    ):
        raise ValueError(f"{owner}: num_classes={num_classes!r} must be an int >= 2 (or None: read from the outputs).")
    return num_classes


def mixup_batch(
    inputs: torch.Tensor, targets: torch.Tensor, alpha: float = 0.2, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Mix a batch for a custom loop: returns ``(mixed_inputs, permuted_targets, mixing)``.

    Train with ``(1 - mixing) * loss(out, targets) + mixing * loss(out, permuted_targets)``.
    """
    mixed, permutation, mixing = _mixup(inputs, check_alpha("mixup_batch", alpha), generator)
    return mixed, targets[permutation], mixing


def _mixup(
    inputs: torch.Tensor, alpha: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    mixing = sample_mixing(alpha, generator)
    permutation = random_permutation(inputs.shape[0], inputs.device, generator)
    return (1.0 - mixing) * inputs + mixing * inputs[permutation], permutation, mixing


class MixingAlgorithm(Algorithm):
    """Pairs each sample with another of its batch, mixes their inputs (subclass) and their targets (here)."""

    def __init__(
        self, alpha: float, interpolate_loss: bool, input_key: BatchKey, target_key: BatchKey, num_classes: int | None
    ) -> None:
        self.alpha = check_alpha(type(self).__name__, alpha)
        self.num_classes = check_num_classes(type(self).__name__, num_classes)
        self.interpolate_loss = interpolate_loss
        self.input_key = check_batch_key("input_key", input_key)
        self.target_key = check_batch_key("target_key", target_key)
        self.mixing = 0.0
        self._permutation: torch.Tensor | None = None
        self._original: tuple[Any, Any] | None = None

    @abstractmethod
    def mix(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """``(mixed_inputs, permutation, mixing)``, where ``mixing`` is the share of each permuted partner."""

    @override
    def match(self, event: Event, state: State) -> bool:
        return event in (Event.BEFORE_FORWARD, Event.BEFORE_LOSS, Event.AFTER_LOSS)

    @override
    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event is Event.BEFORE_FORWARD:
            inputs = get_batch_item(state.batch, self.input_key)
            self._original = (inputs, get_batch_item(state.batch, self.target_key))
            mixed, self._permutation, self.mixing = self.mix(inputs)
            state.batch = set_batch_item(state.batch, self.input_key, mixed)
            return
        if self._permutation is None or self._original is None:
            return  # the forward ran without this algorithm having mixed it
        targets = get_batch_item(state.batch, self.target_key)
        if event is Event.BEFORE_LOSS and not self.interpolate_loss:
            self._check_outputs(state.outputs)
            mixed_targets = mix_targets(targets, self._permutation, self.mixing, state.outputs)
            state.batch = set_batch_item(state.batch, self.target_key, mixed_targets)
        elif event is Event.AFTER_LOSS:
            if self.interpolate_loss:
                partner_batch = set_batch_item(state.batch, self.target_key, targets[self._permutation])
                model: Any = state.model  # a model with loss(outputs, batch)
                partner_loss = model.loss(state.outputs, partner_batch)
                state.loss = (1.0 - self.mixing) * state.loss + self.mixing * partner_loss
            inputs, original_targets = self._original
            state.batch = set_batch_item(state.batch, self.input_key, inputs)
            state.batch = set_batch_item(state.batch, self.target_key, original_targets)
            self._permutation = self._original = None

    def _check_outputs(self, outputs: torch.Tensor) -> None:
        if self.num_classes is not None and (outputs.ndim < 2 or outputs.shape[1] != self.num_classes):
            raise ValueError(
                f"{type(self).__name__}(num_classes={self.num_classes}) got outputs of shape {tuple(outputs.shape)}, "
                f"which do not have {self.num_classes} classes along dim 1."
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(alpha={self.alpha})"


class MixUp(MixingAlgorithm):
    """MixUp (see the module docstring). ``alpha`` is the Beta concentration: small values mix little.

    ``num_classes`` (Composer's ``MixUp(num_classes=10, alpha=0.1)``) is optional: the classes are read from the
    outputs' dimension 1, and a given ``num_classes`` is checked against it.
    """

    def __init__(
        self,
        alpha: float = 0.2,
        interpolate_loss: bool = False,
        input_key: BatchKey = 0,
        target_key: BatchKey = 1,
        *,
        num_classes: int | None = None,
    ) -> None:
        super().__init__(alpha, interpolate_loss, input_key, target_key, num_classes)

    @override
    def mix(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        return _mixup(inputs, self.alpha, None)
