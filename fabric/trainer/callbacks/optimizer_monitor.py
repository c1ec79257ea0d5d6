"""``OptimizerMonitor``: L2 norms of the gradients, parameters, optimizer moments and updates, to spot explosions
and dead layers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from typing_extensions import override

from fabric.trainer.callbacks._utils import check_count, user_model
from fabric.trainer.core.callback import Callback
from fabric.wrappers import unwrap_optimizer

if TYPE_CHECKING:
    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State

#: Optimizer state entries holding a first moment: Adam's family, and SGD's momentum.
_MOMENT_KEYS = ("exp_avg", "momentum_buffer")


class OptimizerMonitor(Callback):
    """Logs Composer's ``l2_norm/<kind>/global`` (and with ``log_per_layer`` ``l2_norm/<kind>/<name>``) norms.

    * ``grad`` and ``param`` at ``AFTER_TRAIN_BATCH``: that event comes before the optimizer step with the
      batch's gradients complete (accumulated over microbatches, averaged over DDP ranks, unscaled), so the
      gradient norm is the one the step uses.
    * ``moment`` at ``BATCH_END``, after the step, with ``log_optimizer_metrics``: the norm of each parameter's
      first moment in the optimizer's state (Adam's ``exp_avg``, SGD's ``momentum_buffer``); nothing for
      optimizers without one.
    * ``update`` at ``BATCH_END`` with ``log_update_norms``: the norm of what the step changed,
      ``param_after - param_before``, exact for any optimizer (learning rate, weight decay and clipping
      included). It keeps a copy of the trainable parameters from ``BATCH_START`` to ``BATCH_END`` of the
      logged batches, so it is off by default.

    Only trainable parameters count; ``<name>`` is the parameter's name in the user's model (not its
    wrappers). Norms are computed in float32. Everything is logged every ``batch_log_interval`` batches at the
    step of the batch trained, next to its loss (Composer logs every 10 by default, and every layer).
    """

    def __init__(
        self,
        log_optimizer_metrics: bool = True,
        batch_log_interval: int = 1,
        *,
        log_per_layer: bool = False,
        log_update_norms: bool = False,
    ) -> None:
        for name, flag in (
            ("log_optimizer_metrics", log_optimizer_metrics),
            ("log_per_layer", log_per_layer),
            ("log_update_norms", log_update_norms),
        ):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False; got {flag!r}.")
        self.log_optimizer_metrics = log_optimizer_metrics
        self.batch_log_interval = check_count(batch_log_interval, "batch_log_interval", 1)
        self.log_per_layer = log_per_layer
        self.log_update_norms = log_update_norms
        self._before_step: dict[str, torch.Tensor] | None = None

    def _logs(self, step: int) -> bool:
        return step % self.batch_log_interval == 0

    @override
    def batch_start(self, state: State, logger: Logger) -> None:
        self._before_step = None
        if self.log_update_norms and self._logs(int(state.timestamp.batch) + 1):
            self._before_step = {
                name: parameter.detach().clone() for name, parameter in _trained_parameters(user_model(state))
            }

    @override
    def after_train_batch(self, state: State, logger: Logger) -> None:
        step = int(state.timestamp.batch) + 1  # the batch being trained, as its loss
        if not self._logs(step):
            return
        param_norms, grad_norms = {}, {}
        for name, parameter in _trained_parameters(user_model(state)):
            param_norms[name] = _norm(parameter)
            if parameter.grad is not None:
                grad_norms[name] = _norm(parameter.grad)
        metrics = self._norm_metrics("param", param_norms)
        metrics.update(self._norm_metrics("grad", grad_norms))
        if metrics:
            logger.log_metrics(metrics, step=step)

    @override
    def batch_end(self, state: State, logger: Logger) -> None:
        step = int(state.timestamp.batch)  # advanced past the batch just trained
        before, self._before_step = self._before_step, None
        if not self._logs(step):
            return
        model = user_model(state)
        metrics: dict[str, torch.Tensor] = {}
        if self.log_optimizer_metrics:
            metrics.update(self._norm_metrics("moment", _moment_norms(model, state.optimizers)))
        if before is not None:
            trained = dict(_trained_parameters(model))
            updates = {name: _norm(trained[name].detach() - old) for name, old in before.items() if name in trained}
            metrics.update(self._norm_metrics("update", updates))
        if metrics:
            logger.log_metrics(metrics, step=step)

    def _norm_metrics(self, kind: str, norms: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``l2_norm/<kind>/global`` (the norm of all tensors together) and, per layer, ``l2_norm/<kind>/<name>``."""
        if not norms:
            return {}
        metrics = {f"l2_norm/{kind}/global": torch.linalg.vector_norm(torch.stack(list(norms.values())))}
        if self.log_per_layer:
            metrics.update({f"l2_norm/{kind}/{name}": norm for name, norm in norms.items()})
        return metrics


def _trained_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad]


def _norm(tensor: torch.Tensor) -> torch.Tensor:
    """The L2 norm, in float32 whatever the tensor's dtype."""
    norm: torch.Tensor = torch.linalg.vector_norm(tensor.detach(), dtype=torch.float32)
    return norm


def _moment_norms(model: nn.Module, optimizers: list[Any]) -> dict[str, torch.Tensor]:
    """Per trained parameter, the norm of the first moment its optimizer holds (none before the first step)."""
    names: dict[torch.Tensor, str] = {parameter: name for name, parameter in _trained_parameters(model)}
    norms = {}
    for optimizer in optimizers:
        for parameter, entries in unwrap_optimizer(optimizer).state.items():
            name = names.get(parameter)
            moment = next((entries[key] for key in _MOMENT_KEYS if isinstance(entries.get(key), torch.Tensor)), None)
            if name is not None and moment is not None:
                norms[name] = _norm(moment)
    return norms
