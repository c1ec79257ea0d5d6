"""GyroDropout: dropout that trains a fixed, pre-selected set of subnetworks instead of a new one per sample.

Park, Lee and Seo's gyro dropout (Composer's ``GyroDropout``; "Gyro Dropout: Maximizing Ensemble Effect in
Neural Network Training", MLSys 2022). Ordinary dropout samples a fresh mask for every sample, so each of
the astronomically many subnetworks is trained barely once; gyro dropout draws ``sigma`` masks once, and at
every step trains ``tau`` of them, each on a ``1 / tau`` slice of the batch, switching to ``tau`` other masks
(drawn from the ``sigma``, with replacement) every ``iter_num = int(total_steps * tau / sigma)`` steps, so
that over training every pre-selected subnetwork gets about the same share of the data. Kept units are scaled
by ``1 / (1 - p)``; in evaluation the layer is the identity.

Composer's arguments: ``p`` (drop probability), ``sigma`` (pre-selected masks) and ``tau`` (masks per step);
the functional form also takes ``iters_per_epoch`` and ``max_epoch``, whose product is the number of training
steps. Differences from Composer's layer, all documented here: a mask covers the last dimension of the input
(the features of a Linear layer, ``(N, ..., F)``; shared by every position of a sample; for 2-d inputs this
is Composer's mask), the batch dimension comes first and may be any size (the ``tau`` slices are near-equal,
where Composer needed a multiple of ``tau``), ``iter_num`` is at least 1, and draws use torch's global
generator. Steps are counted in training-mode forward passes of the layer, as in Composer (with microbatches
or optimizers that re-run the forward, there are more of them than batches).

The algorithm fires at ``Event.FIT_START`` (it needs the training length): every ``nn.Dropout`` (exactly
that class) becomes a :class:`GyroDropoutLayer` with ``total_steps`` the batches of ``max_duration`` (``ep``
counted through the train dataloader's length, or ``ba``). The state dict of the model is unchanged; the
layers' masks and step counts are in the algorithm's state dict, so a resumed run continues them.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State
from fabric.trainer.core.time import TimeUnit
from fabric.trainer.surgery import replace_modules


def _check(p: float, sigma: int, tau: int) -> None:
    if isinstance(p, bool) or not isinstance(p, int | float) or not 0 <= p < 1:
        raise ValueError(f"GyroDropout: p={p!r} must be a drop probability in [0, 1).")
    for name, value in (("sigma", sigma), ("tau", tau)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"GyroDropout: {name}={value!r} must be a positive integer.")


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"GyroDropout: {name}={value!r} must be a positive integer.")


class GyroDropoutLayer(nn.Module):
    """Dropout over ``tau`` of ``sigma`` pre-selected masks per step (see the module docstring)."""

    def __init__(self, iters_per_epoch: int, max_epoch: int, p: float = 0.5, sigma: int = 256, tau: int = 16) -> None:
        super().__init__()
        _check(p, sigma, tau)
        _check_count("iters_per_epoch", iters_per_epoch)
        _check_count("max_epoch", max_epoch)
        self.iters_per_epoch, self.max_epoch = iters_per_epoch, max_epoch
        self.p, self.sigma, self.tau = float(p), sigma, tau
        #: Steps between switching to ``tau`` other masks.
        self.iter_num = max(1, int(iters_per_epoch * max_epoch * tau / sigma))
        self.training_step = 0
        #: ``(sigma, features)`` 0/1 masks, drawn at the first training forward; ``(tau, features)`` in use.
        self.preselect_masks: torch.Tensor | None = None
        self.selected_masks: torch.Tensor | None = None

    @override
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return input
        if input.ndim < 2:
            raise ValueError(f"GyroDropout needs inputs shaped (N, ..., features), got shape {tuple(input.shape)}.")
        features = input.shape[-1]
        if self.preselect_masks is None:
            self.preselect_masks = (torch.rand(self.sigma, features) > self.p).to(input.device)
        elif self.preselect_masks.shape[1] != features:
            raise ValueError(
                f"GyroDropout drew its masks for {self.preselect_masks.shape[1]} features, but got an input with "
                f"{features} (shape {tuple(input.shape)}); the last dimension must not change."
            )
        if self.selected_masks is None or self.training_step % self.iter_num == 0:
            self.selected_masks = self.preselect_masks[torch.randint(self.sigma, (self.tau,))]
        self.training_step += 1
        mask = self.sample_masks(input.shape[0]).to(device=input.device, dtype=input.dtype)
        return input * mask.view(input.shape[0], *([1] * (input.ndim - 2)), features) / (1 - self.p)

    def sample_masks(self, batch_size: int) -> torch.Tensor:
        """The mask of each of ``batch_size`` samples: ``tau`` near-equal consecutive slices, one mask each."""
        assert self.selected_masks is not None
        sizes = torch.tensor([len(part) for part in torch.arange(batch_size).tensor_split(self.tau)])
        return self.selected_masks.repeat_interleave(sizes.to(self.selected_masks.device), dim=0)

    def state(self) -> dict[str, Any]:
        """What a resumed run needs to continue this layer."""
        return {
            "training_step": self.training_step,
            "preselect_masks": None if self.preselect_masks is None else self.preselect_masks.cpu(),
            "selected_masks": None if self.selected_masks is None else self.selected_masks.cpu(),
        }

    def load(self, state: dict[str, Any]) -> None:
        self.training_step = int(state["training_step"])
        self.preselect_masks, self.selected_masks = state["preselect_masks"], state["selected_masks"]

    @override
    def extra_repr(self) -> str:
        return f"p={self.p}, sigma={self.sigma}, tau={self.tau}, iter_num={self.iter_num}"


def apply_gyro_dropout(
    model: nn.Module, iters_per_epoch: int, max_epoch: int, p: float = 0.5, sigma: int = 256, tau: int = 16
) -> dict[str, tuple[nn.Module, nn.Module]]:
    """Replace every ``nn.Dropout`` of ``model`` by a :class:`GyroDropoutLayer`, in place; returns what was replaced.

    ``iters_per_epoch * max_epoch`` is the number of training steps. Warns when the model has no ``nn.Dropout``.
    """
    _check(p, sigma, tau)
    _check_count("iters_per_epoch", iters_per_epoch)
    _check_count("max_epoch", max_epoch)

    def gyro(module: nn.Module, name: str) -> nn.Module:
        return GyroDropoutLayer(iters_per_epoch, max_epoch, p, sigma, tau)

    replaced = replace_modules(model, {nn.Dropout: gyro})
    if not replaced:
        warnings.warn(f"GyroDropout found no nn.Dropout in {type(model).__name__}; it has no effect.", stacklevel=2)
    return replaced


def training_steps(state: State) -> tuple[int, int]:
    """``(iters_per_epoch, max_epoch)`` for the run's ``max_duration``, whose product is its number of batches."""
    duration = state.max_duration
    if duration is not None and duration.unit is TimeUnit.BATCH:
        return max(1, int(duration.value)), 1
    if duration is not None and duration.unit is TimeUnit.EPOCH and state.dataloader_len:
        return state.dataloader_len, max(1, int(duration.value))
    raise ValueError(
        f"GyroDropout needs the number of training batches: max_duration in 'ep' (with a train dataloader that has "
        f"a length) or 'ba', got {duration}."
    )


class GyroDropout(Algorithm):
    """Gyro dropout in place of every ``nn.Dropout``, set up at FIT_START (see the module docstring)."""

    def __init__(self, p: float = 0.5, sigma: int = 256, tau: int = 16) -> None:
        _check(p, sigma, tau)
        self.p, self.sigma, self.tau = p, sigma, tau
        self.layers: list[GyroDropoutLayer] = []
        self._pending: list[dict[str, Any]] | None = None

    @override
    def match(self, event: Event, state: State) -> bool:
        return event is Event.FIT_START and not self.layers

    @override
    def apply(self, event: Event, state: State, logger: Logger) -> None:
        iters_per_epoch, max_epoch = training_steps(state)
        apply_gyro_dropout(state.model, iters_per_epoch, max_epoch, self.p, self.sigma, self.tau)
        self.layers = list(dict.fromkeys(m for m in state.model.modules() if isinstance(m, GyroDropoutLayer)))
        if self._pending is not None:
            self._restore(self._pending)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"layers": [layer.state() for layer in self.layers]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.layers:
            self._restore(state_dict["layers"])
        else:  # the layers are made at FIT_START
            self._pending = list(state_dict["layers"])

    def _restore(self, states: Sequence[dict[str, Any]]) -> None:
        if len(states) != len(self.layers):
            raise ValueError(
                f"The checkpoint holds the state of {len(states)} gyro dropout layers; the model has "
                f"{len(self.layers)}."
            )
        for layer, layer_state in zip(self.layers, states, strict=True):
            layer.load(layer_state)
        self._pending = None

    def __repr__(self) -> str:
        return f"GyroDropout(p={self.p}, sigma={self.sigma}, tau={self.tau})"
