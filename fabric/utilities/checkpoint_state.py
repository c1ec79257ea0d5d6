"""Turn live objects into checkpoint state and back, validating everything before changing anything.

A load is a transaction: every entry is checked against the object it is meant for (keys, shapes,
parameter-group sizes) before the first object is modified, so a wrong or foreign checkpoint raises
:class:`CheckpointError` and leaves the user's model and optimizers exactly as they were.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn, Protocol, runtime_checkable

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from fabric.utilities.exceptions import CheckpointError


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: LR schedulers, samplers, user objects."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class SavedDataLoader:
    """A data loader without ``state_dict()`` as a checkpoint holds it: its pickle, kept opaque.

    Lightning pickles such a loader into the checkpoint (litgpt's ``pretrain`` saves its ``train_dataloader``), so
    the file needs ``weights_only=False`` to load, and programs that resume with the safe default crash (litgpt's
    ``--resume`` does under Lightning with torch >= 2.6). Kept as bytes, the checkpoint loads safely; the live loader
    in a load's ``state`` stays as it is, and ``weights_only=False`` (a trusted file) rebuilds the saved one.
    """

    def __init__(self, pickled: bytes) -> None:
        self.pickled = pickled

    def __reduce__(self) -> tuple[type[SavedDataLoader], tuple[bytes]]:
        return SavedDataLoader, (self.pickled,)

    def rebuild(self) -> DataLoader[Any]:
        """The saved loader. This unpickles it, which runs code from the file: only for trusted checkpoints."""
        loader: DataLoader[Any] = pickle.loads(self.pickled)
        return loader

    def __iter__(self) -> Iterator[Any]:
        self._refuse("iterated")

    def __len__(self) -> int:
        self._refuse("measured")

    def _refuse(self, what: str) -> NoReturn:
        raise TypeError(
            f"This data loader was saved pickled and loaded with weights_only=True, so it cannot be {what}: load "
            "the checkpoint with weights_only=False (only for files you trust), or call .rebuild()."
        )


torch.serialization.add_safe_globals([SavedDataLoader])


def saved_form(obj: object) -> Any:
    """What a checkpoint holds for an entry that is neither a module nor an optimizer: the ``state_dict()`` of a
    stateful object (a scheduler, a resumable loader), a loader without one as a :class:`SavedDataLoader`, any
    other value itself."""
    if isinstance(obj, Stateful):
        return obj.state_dict()
    if isinstance(obj, DataLoader):
        return SavedDataLoader(pickle.dumps(obj))
    return obj


def loaded_value(live: object, saved: object, weights_only: bool) -> Any:
    """What a load's ``state[key]`` holds afterwards for a live object without ``load_state_dict()``: the saved
    value, except that a live loader stays (a loader saved without state has nothing to restore) and a trusted
    load (``weights_only=False``) rebuilds a saved loader."""
    if not isinstance(saved, SavedDataLoader):
        return saved
    if isinstance(live, DataLoader):
        return live
    return saved if weights_only else saved.rebuild()


def rebuilt_loaders(checkpoint: dict[str, Any], weights_only: bool) -> dict[str, Any]:
    """A raw checkpoint as ``fabric.load(path)`` returns it: with ``weights_only=False`` the saved loaders
    rebuilt, as Lightning returns them; otherwise as they are."""
    return {key: loaded_value(None, value, weights_only) for key, value in checkpoint.items()}


def loadable_state(module: nn.Module) -> dict[str, Any]:
    """The entries ``module.load_state_dict`` takes: its ``state_dict()``, except where a submodule loads another form
    than it saves and says so with ``loadable_entries()`` (a quantized Linear layer takes the full-precision weight of
    the layer it replaced, and quantizes it as it loads)."""
    state = module.state_dict()
    for name, submodule in module.named_modules():
        entries = getattr(submodule, "loadable_entries", None)
        if entries is None:
            continue
        prefix = f"{name}." if name else ""
        state = {key: value for key, value in state.items() if not key.startswith(prefix)} | {
            f"{prefix}{key}": value for key, value in entries().items()
        }
    return state


def check_module_state(module: nn.Module, state_dict: object, strict: bool, where: str) -> None:
    """Raise unless ``module.load_state_dict(state_dict, strict)`` would load every entry without error."""
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(f"{where}: expected a module state dict, found {type(state_dict).__name__}.")
    expected = loadable_state(module)
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
