"""Activation checkpointing of whole modules: a module's forward keeps only its inputs, and the backward recomputes
the rest (torch's non-reentrant ``torch.utils.checkpoint``)."""

from __future__ import annotations

import types
from typing import Any

from torch import nn


def checkpoint_activations(module: nn.Module) -> None:
    """Make ``module``'s forward recompute itself in the backward, in place (its class, names and state dict stay).

    Each call opens a checkpoint of its own, so a backward split in two (the pipeline's zero-bubble schedules: the
    inputs' gradients, later the weights') recomputes it for each part; torch's composable ``checkpoint(module)``
    keeps one context per module and fails the second time. Bound to the module, so a deep copy (EMA's) recomputes
    with its own weights.
    """
    module.forward = types.MethodType(_checkpointed_forward, module)


def _checkpointed_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

    return checkpoint(type(module).forward, module, *args, use_reentrant=False, **kwargs)
