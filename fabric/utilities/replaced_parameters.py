"""Parameters that a precision plugin swapped for new objects while converting a module.

torchao's float8 all-gather, for one, wraps each converted weight in a new ``nn.Parameter``. An optimizer built from
the model before ``fabric.setup`` still holds the old objects, which the model no longer uses: it would step tensors
that never receive a gradient and the run would not train, silently. Fabric records every such swap by parameter
name and re-points each optimizer it sets up at the new objects.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

from torch import nn
from torch.optim import Optimizer


class ReplacedParameters:
    """Old parameter (by identity, held weakly) -> the parameter that replaced it in a converted module."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref[nn.Parameter], nn.Parameter]] = {}

    def record(self, before: Mapping[str, nn.Parameter], module: nn.Module) -> None:
        """Compare ``module``'s parameters with ``before`` (its ``named_parameters()`` before the conversion)."""
        for name, parameter in module.named_parameters():
            original = before.get(name)
            if original is not None and original is not parameter:
                self._by_id[id(original)] = (weakref.ref(original), parameter)

    def repoint(self, optimizer: Optimizer) -> None:
        """Point ``optimizer``'s groups (and any state it holds) at the replacements of the parameters it holds."""
        if not self._by_id:
            return
        for group in optimizer.param_groups:
            group["params"] = [self._replacement(parameter, optimizer) for parameter in group["params"]]

    def _replacement(self, parameter: nn.Parameter, optimizer: Optimizer) -> nn.Parameter:
        original, replacement = self._by_id.get(id(parameter), (None, None))
        if original is None or original() is not parameter or replacement is None:
            return parameter
        if parameter in optimizer.state:
            optimizer.state[replacement] = optimizer.state.pop(parameter)
        return replacement
