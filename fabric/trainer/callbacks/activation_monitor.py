"""``ActivationMonitor``: statistics of every module's inputs and outputs now and then, to spot exploding or
collapsing activations."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from typing_extensions import override

from fabric.trainer.callbacks._utils import check_interval, user_model
from fabric.trainer.core.callback import Callback
from fabric.trainer.core.time import Time

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State

#: The name of the model itself (the root module, whose name in ``named_modules`` is empty).
ROOT_NAME = "full_model"


class ActivationMonitor(Callback):
    """Logs, every ``interval``, statistics of each module's floating-point inputs and outputs.

    On the first forward pass (the first microbatch) of every batch whose count (or epoch, for an interval in
    ``ep``) is a multiple of ``interval``, forward hooks on every module record, for the ``n``-th input and
    output tensor of the module named ``<module>`` (``full_model`` for the model itself), Composer's::

        activations/l2_norm/<module>_input.<n>    mean over rows of the L2 norm over the last dimension
        activations/average/<module>_input.<n>    mean of all values
        activations/kurtosis/<module>_input.<n>   mean over rows of the kurtosis over the last dimension
        activations/max/<module>_input.<n>        mean over rows of the maximum over the last dimension

    and the same with ``_output.<n>``. Tensors nested in lists, tuples or dicts add ``_<i>`` to the module
    name (Composer's scheme): the ``(x, y)`` batch a Trainer model receives gives ``full_model_0_input.0``
    for ``x``. Integer and boolean tensors are skipped. The hooks are removed after that forward pass, and
    the values are logged at the step of the batch being trained, with one device sync.

    ``ignore_module_types`` skips modules whose name contains one of its strings (Composer's rule, e.g.
    ``['dropout']``) or that are instances of one of its ``nn.Module`` classes. With ``only_log_wandb``
    (Composer's default) the values go only to the run's ``WandBLogger`` destinations when it has any, and
    to every destination otherwise.
    """

    def __init__(
        self,
        interval: int | str | Time[int] = "25ba",
        ignore_module_types: Sequence[str | type[nn.Module]] | None = None,
        only_log_wandb: bool = True,
    ) -> None:
        self.interval = check_interval(interval, "interval")
        ignored = list(ignore_module_types or ())
        if isinstance(ignore_module_types, str) or not all(_is_ignore_rule(rule) for rule in ignored):
            raise ValueError(
                "ignore_module_types must be a list of module name fragments (str) or nn.Module classes; "
                f"got {ignore_module_types!r}."
            )
        if not isinstance(only_log_wandb, bool):
            raise ValueError(f"only_log_wandb must be True or False; got {only_log_wandb!r}.")
        self.ignore_module_types = ignored
        self.only_log_wandb = only_log_wandb
        self._handles: list[RemovableHandle] = []
        self._recorded: dict[str, torch.Tensor] = {}
        self._last_logged: int | None = None  # the interval-unit count last logged

    @override
    def before_forward(self, state: State, logger: Logger) -> None:
        if self._due(state) and not self._handles:
            self._attach(user_model(state))

    @override
    def after_forward(self, state: State, logger: Logger) -> None:
        if not self._handles:
            return
        self._detach()
        self._last_logged = int(state.timestamp.get(self.interval.unit))
        recorded, self._recorded = self._recorded, {}
        if recorded:
            values = torch.stack(list(recorded.values())).tolist()  # one sync for all of them
            self._log(dict(zip(recorded, values, strict=True)), int(state.timestamp.batch) + 1, logger)

    @override
    def fit_end(self, state: State, logger: Logger) -> None:
        self._detach()  # a forward that raised left them on

    def _due(self, state: State) -> bool:
        count = int(state.timestamp.get(self.interval.unit))
        return count % self.interval.value == 0 and count != self._last_logged

    def _attach(self, model: nn.Module) -> None:
        for name, module in model.named_modules():
            if not self._ignores(name, module):
                self._handles.append(module.register_forward_hook(self._hook(name or ROOT_NAME)))

    def _detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _ignores(self, name: str, module: nn.Module) -> bool:
        for rule in self.ignore_module_types:
            if isinstance(rule, str) and rule in (name or ROOT_NAME):
                return True
            if isinstance(rule, type) and isinstance(module, rule):
                return True
        return False

    def _hook(self, name: str) -> Any:
        def record(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            with torch.no_grad():
                for index, value in enumerate(inputs):
                    self._record(name, f"_input.{index}", value)
                outputs = output if isinstance(output, Sequence | Mapping) else (output,)
                values = outputs.values() if isinstance(outputs, Mapping) else outputs
                for index, value in enumerate(values):
                    self._record(name, f"_output.{index}", value)

        return record

    def _record(self, name: str, suffix: str, value: object) -> None:
        """The statistics of ``value``, or of the tensors nested in it (``<name>_<i>``)."""
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and value.numel() > 0:
                for statistic, result in activation_statistics(value).items():
                    self._recorded[f"activations/{statistic}/{name}{suffix}"] = result
        elif isinstance(value, Mapping):
            for index, item in enumerate(value.values()):
                self._record(f"{name}_{index}", suffix, item)
        elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
            for index, item in enumerate(value):
                self._record(f"{name}_{index}", suffix, item)

    def _log(self, metrics: dict[str, float], step: int, logger: Logger) -> None:
        from fabric.trainer.loggers.wandb_logger import WandBLogger  # imports no wandb

        wandb = [each for each in logger.destinations if isinstance(each, WandBLogger)]
        if self.only_log_wandb and wandb:
            for destination in wandb:
                destination.log_metrics(metrics, step)
        else:
            logger.log_metrics(metrics, step=step)


def activation_statistics(value: torch.Tensor) -> dict[str, torch.Tensor]:
    """Composer's statistics of an activation, over its last dimension (rows: all the others), in float32."""
    value = value.detach().float()
    if value.dim() == 0:
        value = value.reshape(1)
    centred = value - value.mean(dim=-1, keepdim=True)
    variance = centred.pow(2).mean(dim=-1)
    kurtosis = centred.pow(4).mean(dim=-1) / variance.pow(2)
    return {
        "l2_norm": torch.linalg.vector_norm(value, dim=-1).mean(),
        "average": value.mean(),
        "kurtosis": kurtosis.mean(),
        "max": value.amax(dim=-1).mean(),
    }


def _is_ignore_rule(rule: object) -> bool:
    return isinstance(rule, str) or (isinstance(rule, type) and issubclass(rule, nn.Module))
