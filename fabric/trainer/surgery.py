"""Model surgery: swapping modules of a model for others, keeping optimizers and checkpoints consistent.

Surgery algorithms (BlurPool, GhostBatchNorm, Factorize, StochasticDepth, WeightStandardization) change
the model once, at ``Event.INIT``. Three things make that safe:

- :func:`replace_modules` swaps every submodule of a given class for what a factory builds from it,
  and re-points the optimizers (:func:`update_params_in_optimizer`): the user built them on the
  original model's parameters, and a replacement with new parameters would otherwise never train.
- :class:`SurgeryAlgorithm` is the base of those algorithms; ``changes_module_structure`` says whether
  the model's state dict no longer fits an unmodified model.
- :func:`surgery_records` turns the applied algorithms into plain data to store in a checkpoint, and
  :func:`reapply_surgery` replays them on a fresh model before its state dict is loaded, so a
  checkpoint saved after surgery loads into a model built by the same user code.
"""

from __future__ import annotations

import importlib
import sys
from abc import abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State

ModuleT = TypeVar("ModuleT", bound=nn.Module)

#: Builds the replacement of ``module`` (found under the qualified ``name``), or returns None to keep it.
ModuleFactory = Callable[[nn.Module, str], nn.Module | None]


def replace_modules(
    model: nn.Module,
    policy: Mapping[type[nn.Module], ModuleFactory],
    optimizers: Iterable[Optimizer] = (),
) -> dict[str, tuple[nn.Module, nn.Module]]:
    """Replace every submodule whose class is a key of ``policy`` by what its factory returns.

    Classes match exactly, not by ``isinstance``: a subclass (``BlurConv2d`` is a ``Conv2d``, a
    parametrized ``Conv2d`` is a generated subclass) has its own behaviour that a replacement built for
    the base class would drop. Replacements are not searched again, and a module reachable under two
    names gets a single replacement. Neither the root module nor anything inside a replaced module is
    replaced.

    A replacement takes the original's train/eval mode. Parameters of a replacement that are not the
    original's are swapped into ``optimizers``, in the parameter group the original's parameters were
    in (see :func:`update_params_in_optimizer`).

    Returns ``{qualified name: (original, replacement)}`` for every replaced submodule.
    """
    optimizers = list(optimizers)
    targets = [
        (name, module)
        for name, module in model.named_modules(remove_duplicate=False)
        if name and type(module) in policy
    ]
    replacements: dict[int, nn.Module | None] = {}
    replaced: dict[str, tuple[nn.Module, nn.Module]] = {}
    for name, module in targets:
        if any(name.startswith(f"{outer}.") for outer in replaced):
            continue  # inside a module that was just replaced
        if id(module) not in replacements:  # else: a module met before under another name
            built = policy[type(module)](module, name)
            if built is not None:
                built.train(module.training)
                update_params_in_optimizer(list(module.parameters()), list(built.parameters()), optimizers)
            replacements[id(module)] = built
        replacement = replacements[id(module)]
        if replacement is None:
            continue
        parent_name, _, attribute = name.rpartition(".")
        model.get_submodule(parent_name).register_module(attribute, replacement)
        replaced[name] = (module, replacement)
    return replaced


def update_params_in_optimizer(
    old_params: Sequence[nn.Parameter], new_params: Sequence[nn.Parameter], optimizers: Iterable[Optimizer]
) -> None:
    """Swap ``old_params`` for ``new_params`` in every optimizer that holds any of the old ones.

    The new parameters join the group of the first old parameter found (keeping its learning rate and
    weight decay); the old ones leave every group, with their optimizer state. Parameters in both lists
    stay where they are, state included. An optimizer holding none of ``old_params`` is left alone, so
    the replacement of a module that was not being optimized (a frozen one) is not optimized either.
    """
    old_ids = {id(p) for p in old_params}
    kept_ids = old_ids & {id(p) for p in new_params}
    for optimizer in optimizers:
        groups = [group for group in optimizer.param_groups if any(id(p) in old_ids for p in group["params"])]
        if not groups:
            continue
        for group in groups:
            for param in group["params"]:
                if id(param) in old_ids and id(param) not in kept_ids:
                    optimizer.state.pop(param, None)
            group["params"] = [p for p in group["params"] if id(p) not in old_ids or id(p) in kept_ids]
        present = {id(p) for group in optimizer.param_groups for p in group["params"]}
        groups[0]["params"].extend(p for p in new_params if id(p) not in present)


def share_tensors(source: nn.Module, target: ModuleT) -> ModuleT:
    """Give ``target`` the very parameter and buffer objects of ``source`` (same names), and return it.

    Replacements that only change ``forward`` use this: the state dict keeps its keys and values, and
    optimizers keep optimizing the same parameters.
    """
    for name, parameter in source.named_parameters(recurse=False):
        target.register_parameter(name, parameter)
    for name, buffer in source.named_buffers(recurse=False):
        target.register_buffer(name, buffer, persistent=name not in source._non_persistent_buffers_set)
    return target


class SurgeryAlgorithm(Algorithm):
    """An algorithm that modifies the model once, at ``Event.INIT``.

    Subclasses implement :meth:`apply_surgery` and :meth:`hparams` (the constructor arguments, as plain
    data, so that :func:`reapply_surgery` can rebuild the algorithm from a checkpoint).
    """

    #: Whether the surgery changes the model's modules or state-dict keys, so that a checkpoint saved
    #: after it loads only into a model that went through it too (False for ChannelsLast: memory format only).
    changes_module_structure: ClassVar[bool] = True

    @override
    def match(self, event: Event, state: State) -> bool:
        return event == Event.INIT

    @override
    def apply(self, event: Event, state: State, logger: Logger) -> None:
        self.apply_surgery(state.model, state.optimizers)

    @abstractmethod
    def apply_surgery(self, model: nn.Module, optimizers: Sequence[Optimizer] = ()) -> None:
        """Modify ``model`` in place, re-pointing ``optimizers`` at any new parameters."""

    @abstractmethod
    def hparams(self) -> dict[str, Any]:
        """The constructor's keyword arguments, as plain data (str, int, float, bool, None, lists)."""

    def __repr__(self) -> str:
        arguments = ", ".join(f"{name}={value!r}" for name, value in self.hparams().items())
        return f"{type(self).__name__}({arguments})"


def surgery_records(algorithms: Iterable[Algorithm]) -> list[dict[str, Any]]:
    """What to store in a checkpoint so that :func:`reapply_surgery` can replay the structural surgery.

    One ``{"algorithm": "module.Class", "hparams": {...}}`` per algorithm that changes the module
    structure, in the order given (the order they ran at INIT). Plain data: loads with ``weights_only``.
    """
    return [
        {"algorithm": f"{type(algorithm).__module__}.{type(algorithm).__qualname__}", "hparams": algorithm.hparams()}
        for algorithm in algorithms
        if isinstance(algorithm, SurgeryAlgorithm) and algorithm.changes_module_structure
    ]


def reapply_surgery(
    model: nn.Module,
    records: Sequence[Mapping[str, Any]],
    optimizers: Sequence[Optimizer] = (),
    already_applied: Iterable[Algorithm] = (),
) -> list[SurgeryAlgorithm]:
    """Replay recorded surgery on a freshly built ``model``, so the checkpoint's state dict fits it.

    Call this before ``model.load_state_dict``. Records whose algorithm class is among
    ``already_applied`` (the run's own algorithms, whose surgery already happened at INIT) are skipped.
    Returns the algorithms that were rebuilt and applied.
    """
    applied_classes = {type(algorithm) for algorithm in already_applied}
    rebuilt: list[SurgeryAlgorithm] = []
    for record in records:
        kind = _surgery_class(str(record["algorithm"]))
        if kind in applied_classes:
            continue
        algorithm = kind(**dict(record["hparams"]))
        algorithm.apply_surgery(model, optimizers)
        rebuilt.append(algorithm)
    return rebuilt


def _surgery_class(path: str) -> type[SurgeryAlgorithm]:
    module_name, _, class_name = path.rpartition(".")
    if not module_name.startswith("fabric.trainer.algorithms.") and module_name not in sys.modules:
        # A checkpoint must not make us import arbitrary modules: user surgery classes are found only
        # when their module is already imported.
        raise ValueError(
            f"The checkpoint records surgery by {path!r}; import {module_name!r} before loading to re-apply it."
        )
    try:
        kind = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError):
        raise ValueError(f"The checkpoint records surgery by {path!r}, which cannot be imported.") from None
    if not (isinstance(kind, type) and issubclass(kind, SurgeryAlgorithm)):
        raise ValueError(f"The checkpoint records surgery by {path!r}, which is not a SurgeryAlgorithm.")
    return kind
