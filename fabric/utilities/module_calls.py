"""Running a module's methods other than ``forward`` through a strategy wrapper that only knows ``forward``.

Strategy wrappers do their work around ``module(...)``: DDP prepares the gradient all-reduce, FSDP
gathers sharded parameters, DeepSpeed does either. A call of another method on the user's module
(``model.training_step(batch)``) bypasses them; under DDP it trains silently wrong (each rank keeps
its own gradient).

- :func:`forward_redirected` lets the wrapper run such a method: for one call, the module's ``forward``
  is the method (which itself sees the real ``forward`` again).
- :func:`parameter_calls_refused` makes a method that was not routed fail before it runs any of the
  module's parameters: before any submodule holding parameters runs, and when ``forward`` is called.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

_MISSING = object()


def _instance_attribute_restorer(module: nn.Module, name: str) -> Callable[[], None]:
    """A function that puts ``module.__dict__[name]`` back as it is now (absent, usually)."""
    saved = module.__dict__.get(name, _MISSING)

    def restore() -> None:
        if saved is _MISSING:
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = saved

    return restore


@contextlib.contextmanager
def forward_redirected(module: nn.Module, method_name: str) -> Iterator[None]:
    """Inside the context, the next call of ``module.forward`` runs ``module.<method_name>`` instead.

    Call the strategy wrapper inside it: the wrapper's hooks run around the method as around a forward.
    """
    method = getattr(module, method_name)
    restore = _instance_attribute_restorer(module, "forward")

    def redirected(*args: Any, **kwargs: Any) -> Any:
        restore()  # the method may call the real forward itself
        return method(*args, **kwargs)

    module.__dict__["forward"] = redirected
    try:
        yield
    finally:
        restore()  # also when the wrapper failed before reaching forward


@contextlib.contextmanager
def parameter_calls_refused(module: nn.Module, refuse: Callable[[nn.Module], NoReturn]) -> Iterator[None]:
    """Inside the context, ``refuse(submodule)`` (which raises) runs instead of ``module.forward`` and before
    any of ``module``'s submodules that hold parameters runs. Other modules (those of other models, a loss
    module without parameters, metrics) run as usual."""
    members: set[int] | None = None

    def check(called: nn.Module, args: Any) -> None:
        nonlocal members
        if next(called.parameters(recurse=False), None) is None:
            return
        if members is None:
            members = {id(submodule) for submodule in module.modules()}
        if id(called) in members:
            refuse(called)

    def refused_forward(*args: Any, **kwargs: Any) -> NoReturn:
        refuse(module)

    restore = _instance_attribute_restorer(module, "forward")
    module.__dict__["forward"] = refused_forward
    handle = register_module_forward_pre_hook(check)
    try:
        yield
    finally:
        handle.remove()
        restore()
