"""``OptimizerMonitor``: log the L2 norms of the gradients and parameters, to spot explosions and dead layers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fabric.trainer.callback import Callback
from fabric.wrappers import FabricModule

if TYPE_CHECKING:
    from fabric.trainer.state import State


class OptimizerMonitor(Callback):
    """Logs ``l2_norm/grad/global`` and ``l2_norm/param/global`` at ``AFTER_TRAIN_BATCH``.

    That event comes before the optimizer step with the batch's gradients complete: accumulated over
    microbatches, averaged over DDP ranks and unscaled, so the norm is the one the step will use. Only
    trainable parameters count. Values are logged at the step of the batch being trained (the clock
    advances after this event), next to that batch's loss. With ``log_per_layer``, every parameter's
    norms are logged too, under ``l2_norm/grad/<name>`` and ``l2_norm/param/<name>`` (names as in the
    user's model, not its wrappers).
    """

    def __init__(self, log_per_layer: bool = False) -> None:
        self.log_per_layer = log_per_layer

    def after_train_batch(self, state: State, logger: Any) -> None:
        model = state.model.module if isinstance(state.model, FabricModule) else state.model
        param_norms, grad_norms = _norms(model)
        if not param_norms:
            return  # nothing is trained
        metrics = {"l2_norm/param/global": _global_norm(param_norms)}
        if grad_norms:
            metrics["l2_norm/grad/global"] = _global_norm(grad_norms)
        if self.log_per_layer:
            metrics.update({f"l2_norm/param/{name}": norm for name, norm in param_norms.items()})
            metrics.update({f"l2_norm/grad/{name}": norm for name, norm in grad_norms.items()})
        logger.log_metrics(metrics, step=int(state.timestamp.batch) + 1)  # the batch being trained, as its loss


def _norms(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per-parameter L2 norms (in float32, whatever the parameter dtype) of the values and of the gradients."""
    param_norms: dict[str, torch.Tensor] = {}
    grad_norms: dict[str, torch.Tensor] = {}
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        param_norms[name] = torch.linalg.vector_norm(parameter.detach(), dtype=torch.float32)
        if parameter.grad is not None:
            grad_norms[name] = torch.linalg.vector_norm(parameter.grad.detach(), dtype=torch.float32)
    return param_norms, grad_norms


def _global_norm(norms: dict[str, torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all the tensors together: the norm of their norms."""
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(list(norms.values())))
    return total
