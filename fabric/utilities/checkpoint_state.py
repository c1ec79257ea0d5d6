"""Turn live objects into checkpoint state and back, validating everything before changing anything.

A load is a transaction: every entry is checked against the object it is meant for (keys, shapes,
parameter-group sizes) before the first object is modified, so a wrong or foreign checkpoint raises
:class:`CheckpointError` and leaves the user's model and optimizers exactly as they were.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.optim import Optimizer

from fabric.utilities.exceptions import CheckpointError


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: LR schedulers, samplers, user objects."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def check_module_state(module: nn.Module, state_dict: object, strict: bool, where: str) -> None:
    """Raise unless ``module.load_state_dict(state_dict, strict)`` would load every entry without error."""
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(f"{where}: expected a module state dict, found {type(state_dict).__name__}.")
    expected = module.state_dict()
    problems = []
    if strict:
        missing = sorted(set(expected) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(expected))
        if missing:
            problems.append(f"missing keys {_preview(missing)}")
        if unexpected:
            problems.append(f"unexpected keys {_preview(unexpected)}")
    for key in (key for key in expected if key in state_dict):
        value, current = state_dict[key], expected[key]
        if not isinstance(current, torch.Tensor):
            continue  # extra state (``get_extra_state``) is any object; ``set_extra_state`` judges it
        if not isinstance(value, torch.Tensor):
            problems.append(f"{key!r} is a {type(value).__name__}, not a tensor")
        elif is_lazy(current):
            continue  # an uninitialized (lazy) parameter takes the saved shape, as in load_state_dict
        elif value.shape != current.shape:
            problems.append(f"{key!r} has shape {tuple(value.shape)}, the model has {tuple(current.shape)}")
    if problems:
        raise CheckpointError(f"{where} does not fit {type(module).__name__}: {'; '.join(problems)}.")


def check_optimizer_state(optimizer: Optimizer, state_dict: object, where: str) -> None:
    """Raise unless ``state_dict`` matches the optimizer's parameter groups one to one."""
    if not isinstance(state_dict, Mapping) or "param_groups" not in state_dict or "state" not in state_dict:
        raise CheckpointError(f"{where}: expected an optimizer state dict with 'state' and 'param_groups'.")
    saved_sizes = [len(group["params"]) for group in state_dict["param_groups"]]
    current_sizes = [len(group["params"]) for group in optimizer.param_groups]
    if saved_sizes != current_sizes:
        raise CheckpointError(
            f"{where} has parameter groups of sizes {saved_sizes}, but {type(optimizer).__name__} has {current_sizes}."
        )
    # Per-parameter state (e.g. Adam's moments) must match the parameter it belongs to. Tensors of
    # another rank (factored statistics, scalar step counters) have no shape to compare against.
    saved_ids = [param_id for group in state_dict["param_groups"] for param_id in group["params"]]
    parameters = dict(zip(saved_ids, (p for group in optimizer.param_groups for p in group["params"]), strict=True))
    problems = []
    for param_id, param_state in state_dict["state"].items():
        parameter = parameters.get(param_id)
        if parameter is None or not isinstance(param_state, Mapping):
            problems.append(f"state for parameter {param_id!r}, which no parameter group lists")
            continue
        for name, value in param_state.items():
            if isinstance(value, torch.Tensor) and value.dim() == parameter.dim() and value.shape != parameter.shape:
                problems.append(
                    f"{name!r} of parameter {param_id!r} has shape {tuple(value.shape)}, "
                    f"the parameter has {tuple(parameter.shape)}"
                )
    if problems:
        raise CheckpointError(f"{where} does not fit {type(optimizer).__name__}: {'; '.join(problems[:5])}.")


def _preview(keys: list[str], limit: int = 5) -> str:
    shown = ", ".join(map(repr, keys[:limit]))
    return f"[{shown}{', ...' if len(keys) > limit else ''}] ({len(keys)} in all)"
