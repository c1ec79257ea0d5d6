"""SAM: step with the gradient taken at the worst nearby point, to seek flat minima.

With the batch's gradient ``g`` complete, the weights are moved uphill to ``w + rho * g / (||g|| + epsilon)``
(``||g||`` is the L2 norm over all parameters), the forward, loss and backward of the same batch run again
there, the weights are moved back, and the optimizer steps with this second gradient. From "Sharpness-Aware
Minimization for Efficiently Improving Generalization" (Foret et al., ICLR 2021). ``interval=k`` does this
every ``k``-th batch only (the others step with the plain gradient), trading effect for speed.

Event: ``AFTER_TRAIN_BATCH``, before the optimizer step. The batch is recomputed in microbatches of
``state.device_train_microbatch_size`` (if set), each loss weighted by its share of the samples, like the
trainer's own pass. The backward goes through ``state.fabric.backward`` when the trainer has a Fabric, so the
strategy's backward logic applies (DDP all-reduces the gradients, once per batch as in the trainer's pass), and
plain ``loss.backward()`` otherwise.

GradScaler (``precision="16-mixed"``) cannot work: when AFTER_TRAIN_BATCH fires the scaler has already unscaled
this step's gradients and recorded whether they overflowed, so the second backward's gradients would reach the
optimizer multiplied by the loss scale and unchecked for inf/NaN. SAM raises at ``INIT`` (or its first batch)
in that case; ``bf16-mixed`` and full precision need no scaler and work.

The recomputation calls the model directly, without firing events, so algorithms that change the batch or loss
per microbatch (MixUp, CutMix, LabelSmoothing) would not apply to the second gradient: SAM refuses to run with
them. Changes made at ``AFTER_DATALOADER`` (CutOut, ColOut, SelectiveBackprop, ...) are in ``state.batch`` and
apply. List SAM after GradientClipping so that, with closing events running in reverse, SAM's gradient is the
one clipped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from typing_extensions import override

from fabric.trainer.algorithms.cutmix import CutMix
from fabric.trainer.algorithms.label_smoothing import LabelSmoothing
from fabric.trainer.algorithms.mixup import MixUp
from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State
from fabric.trainer.microbatch import batch_size as count_samples
from fabric.trainer.microbatch import loss_weight, split_batch


def _check_positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"SAM: {name}={value!r} must be a finite number greater than 0.")
    return float(value)


@torch.no_grad()
def sam_perturbation(parameters: Sequence[torch.Tensor], rho: float, epsilon: float = 1e-12) -> list[torch.Tensor]:
    """The ascent step ``rho * g / (||g|| + epsilon)`` per parameter (zeros where a parameter has no gradient)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    return [g * (rho / (norm + epsilon)) for g in grads]


def _uses_grad_scaler(state: State) -> bool:
    return state.fabric is not None and bool(state.fabric.strategy.precision.scales_gradients)


class SAM(Algorithm):
    """SAM (see the module docstring)."""

    incompatible_with = (MixUp, CutMix, LabelSmoothing)
    incompatibility_reason = (
        "SAM recomputes the loss on the batch without firing events, so batch and target changes made at those "
        "events would be missing from its second gradient"
    )

    def __init__(self, rho: float = 0.05, epsilon: float = 1e-12, interval: int = 1) -> None:
        self.rho, self.epsilon = _check_positive("rho", rho), _check_positive("epsilon", epsilon)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"SAM: interval={interval!r} must be an int of at least 1.")
        self.interval = interval
        self._checked = False

    @override
    def match(self, event: Event, state: State) -> bool:
        if event is Event.INIT:
            return True
        return event is Event.AFTER_TRAIN_BATCH and int(state.timestamp.batch) % self.interval == 0

    @override
    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if not self._checked:
            if _uses_grad_scaler(state):
                raise ValueError(
                    "SAM cannot run with a GradScaler (precision '16-mixed'): its second gradient would reach the "
                    "optimizer still scaled; use precision 'bf16-mixed' or '32-true'."
                )
            self._checked = True
        if event is Event.AFTER_TRAIN_BATCH:
            self._sharpness_aware_gradient(state)

    def _sharpness_aware_gradient(self, state: State) -> None:
        parameters: list[torch.Tensor] = [p for p in state.model.parameters() if p.requires_grad]
        if all(p.grad is None for p in parameters):
            return
        perturbation = sam_perturbation(parameters, self.rho, self.epsilon)
        originals = [p.detach().clone() for p in parameters]  # copied back: w + e - e is not always w in floats
        with torch.no_grad():
            torch._foreach_add_(parameters, perturbation)
        for parameter in parameters:
            parameter.grad = None
        try:
            self._backward(state)
        finally:
            with torch.no_grad():
                torch._foreach_copy_(parameters, originals)

    def _backward(self, state: State) -> None:
        model: Any = state.model  # a model with forward(batch) and loss(outputs, batch)
        batch, size = state.batch, state.device_train_microbatch_size
        total = count_samples(batch)
        microbatches = split_batch(batch, size) if size else [batch]
        for index, microbatch in enumerate(microbatches):
            loss = model.loss(model(microbatch), microbatch) * loss_weight(microbatch, total)
            if state.fabric is None:
                loss.backward()
                continue
            # Like the trainer's pass: DDP all-reduces once, in the last microbatch's backward.
            with state.fabric.no_backward_sync(model, enabled=index < len(microbatches) - 1):
                state.fabric.backward(loss, model=model)

    def __repr__(self) -> str:
        return f"SAM(rho={self.rho}, interval={self.interval})"
