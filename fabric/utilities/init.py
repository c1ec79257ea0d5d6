"""Building a module without initialising its weights, and refusing to run it until a checkpoint fills them.

``fabric.init_module(empty_init=True)`` saves the (often dominant) time of initialising a large model
that is about to be loaded. Until the load its tensors hold arbitrary memory, so every strategy guards
such a module: its forward raises, naming the tensors and the ways out, until ``fabric.load`` or
``fabric.load_raw`` filled it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

#: Tensor attribute: the tensor's version counter when ``SkipParameterInit`` left it uninitialised.
_SKIPPED_AT_VERSION = "_fabric_init_skipped_at_version"


class DeferredContexts(AbstractContextManager[None]):
    """Context managers made and entered when the ``with`` block starts, not when this object is made.

    ``fabric.init_module()`` combines global modes (``torch.device`` is a torch function mode, a precision sets the
    default dtype): entered eagerly, a context made but never entered, or one whose later part refuses to be entered,
    left them on for the rest of the process. Here a failure while entering undoes what was entered.
    """

    def __init__(self, *makers: Callable[[], AbstractContextManager[Any]]) -> None:
        self._makers = list(makers)
        self._stack: ExitStack | None = None

    def add(self, maker: Callable[[], AbstractContextManager[Any]]) -> None:
        """One more context, entered after the others."""
        self._makers.append(maker)

    def __enter__(self) -> None:
        with ExitStack() as stack:
            for make in self._makers:
                stack.enter_context(make())
            self._stack = stack.pop_all()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> bool | None:
        stack, self._stack = self._stack, None
        return stack.__exit__(kind, error, traceback) if stack is not None else None


class SkipParameterInit(TorchFunctionMode):
    """Turns every ``torch.nn.init`` function into a no-op and remembers the tensors it left uninitialised.

    When the context ends each such tensor is stamped with its version counter, so that
    :func:`uninitialised_tensors` can later tell whether anything wrote to it since (a
    ``load_state_dict``, an in-place initialisation). An inference tensor has no version counter, so the
    modules built here also clear the stamp of each tensor a ``load_state_dict`` fills (litgpt's ``chat``
    builds its model under ``torch.inference_mode()`` and loads it with a plain ``load_state_dict``).
    """

    def __init__(self) -> None:
        super().__init__()
        self._skipped: list[weakref.ref[torch.Tensor]] = []
        self._modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._registrations: list[RemovableHandle] = []

    def __enter__(self) -> SkipParameterInit:
        self._registrations = [
            nn.modules.module.register_module_parameter_registration_hook(self._built),
            nn.modules.module.register_module_buffer_registration_hook(self._built),
        ]
        return super().__enter__()  # type: ignore[no-any-return,no-untyped-call]

    def _built(self, module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
        self._modules.add(module)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        if getattr(func, "__module__", None) == "torch.nn.init":
            tensor = args[0] if args else kwargs.get("tensor") if kwargs else None
            if isinstance(tensor, torch.Tensor):
                self._skipped.append(weakref.ref(tensor))
            return tensor
        return func(*args, **(kwargs or {}))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        super().__exit__(exc_type, exc, traceback)  # type: ignore[no-untyped-call]
        for registration in self._registrations:
            registration.remove()
        for reference in self._skipped:
            tensor = reference()
            if tensor is not None:
                setattr(tensor, _SKIPPED_AT_VERSION, _version(tensor))
        self._skipped.clear()
        for module in self._modules:
            if any(hasattr(tensor, _SKIPPED_AT_VERSION) for tensor in _own_tensors(module).values()):
                module.register_load_state_dict_pre_hook(_forget_loaded_tensors)  # type: ignore[no-untyped-call]
        self._modules = weakref.WeakSet()


def _own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's own parameters and buffers (not its children's), by name."""
    tensors = {**module._parameters, **module._buffers}
    return {name: tensor for name, tensor in tensors.items() if tensor is not None}


def _forget_loaded_tensors(module: nn.Module, state_dict: Mapping[str, Any], prefix: str, *rest: Any) -> None:
    """A ``load_state_dict`` pre-hook: the module's tensors the state dict fills are initialised from now on."""
    for name, tensor in _own_tensors(module).items():
        if prefix + name in state_dict and hasattr(tensor, _SKIPPED_AT_VERSION):
            delattr(tensor, _SKIPPED_AT_VERSION)


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter; ``None`` for an inference tensor (made under ``torch.inference_mode()``,
    as litgpt's ``generate`` builds its model), which has none: such a tensor counts as uninitialised until a
    load into its module lifts the guard, since no write to it can be seen."""
    return None if tensor.is_inference() else tensor._version


def uninitialised_tensors(module: nn.Module) -> list[str]:
    """Names of ``module``'s tensors that :class:`SkipParameterInit` left uninitialised and nothing filled since."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return [
        name
        for name, tensor in tensors
        if hasattr(tensor, _SKIPPED_AT_VERSION) and getattr(tensor, _SKIPPED_AT_VERSION) == _version(tensor)
    ]


def refuse_forward_until_loaded(module: nn.Module, names: list[str], reason: str) -> RemovableHandle:
    """Make ``module``'s forward raise an error naming ``names`` (and ``reason``, why they hold no
    values) until the returned handle is removed, which a load into the module does."""
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    message = (
        f"{type(module).__name__} was built with fabric.init_module(empty_init=True) and {len(names)} of its "
        f"tensors ({shown}) {reason}. Load a checkpoint into it with fabric.load() or fabric.load_raw() before "
        "using it, or build it without empty_init=True to initialise it."
    )

    def refuse(module: nn.Module, args: Any) -> None:
        raise RuntimeError(message)

    return module.register_forward_pre_hook(refuse)
