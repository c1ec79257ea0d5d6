"""What ``fabric.setup*`` hands back: thin wrappers that route the user's calls through the strategy.

- :class:`FabricModule` runs ``forward`` (and methods marked with :meth:`~FabricModule.mark_forward_method`)
  through the strategy's wrapper (DDP, FSDP, DeepSpeed) under the precision plugin, refuses unmarked
  methods that would run parameters past that wrapper, and hides itself from ``state_dict`` keys.
- :func:`wrap_optimizer` returns an object that *is* the user's optimizer (same class, same state,
  so LR schedulers accept it) whose ``step`` goes through the strategy.
- :func:`wrap_dataloader` returns a copy of the user's ``DataLoader`` that moves every batch to the device.

Wrappers add as little as possible to each step: with ``"32-true"`` the module wrapper calls straight
through, and on CPU the dataloader wrapper yields batches untouched.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, NoReturn, TypeVar

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.nn.modules import module as torch_module
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from fabric.strategies.strategy import Strategy
from fabric.utilities.apply_func import move_data_to_device
from fabric.utilities.module_calls import forward_redirected, parameter_calls_refused
from fabric.utilities.wrapped import SetUpByFabric

OptimizerT = TypeVar("OptimizerT", bound=Optimizer)

#: The process-wide hooks (``torch.nn.modules.module.register_module_forward_hook`` and its siblings) that take
#: ``nn.Module.__call__`` off its fast path: torch's own dicts, which it fills in place, never rebinds, and checks
#: (as ``torch.compile`` does) before every call.
_GLOBAL_CALL_HOOKS = (
    torch_module._global_forward_pre_hooks,
    torch_module._global_forward_hooks,
    torch_module._global_backward_pre_hooks,
    torch_module._global_backward_hooks,
)
_tracing_state = torch._C._get_tracing_state


class FabricModule(SetUpByFabric, nn.Module):
    """Wraps a set-up module. Attribute access falls through to the original module.

    Methods other than ``forward`` run through the strategy's wrapper only when marked with
    :meth:`mark_forward_method`. Under a strategy whose wrapper must see the computation (DDP, FSDP,
    DeepSpeed), an unmarked method raises as soon as it would run the module (``self(...)``,
    ``self.forward(...)``) or any submodule holding parameters; unmarked methods that touch no
    parameter-holding submodule (a loss on given outputs, a metric update) run as they are.
    """

    def __init__(self, forward_module: nn.Module, strategy: Strategy, original_module: nn.Module | None = None) -> None:
        super().__init__()
        # ``_forward_module`` may be a strategy wrapper (e.g. DDP) around ``_original_module``.
        self._forward_module = forward_module
        self._original_module = original_module if original_module is not None else forward_module
        # A plain attribute (submodules live in ``_modules``, behind the slower ``__getattr__``) for the
        # per-step call.
        self.__dict__["_forward_call"] = forward_module
        self._strategy = strategy
        self._forward_methods: set[str] = set()
        self._refuse_unmarked = strategy.module_calls_need_wrapper

    @property
    def module(self) -> nn.Module:
        """The user's own module, unwrapped."""
        return self._original_module

    @property
    def device(self) -> torch.device:
        """Where the module's parameters (or, without any, its buffers) are; the strategy's device for a
        module that has neither."""
        for tensor in itertools.chain(self._original_module.parameters(), self._original_module.buffers()):
            return tensor.device
        return self._strategy.root_device

    @override
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``nn.Module.__call__`` with its fast path taken here: with no hook on this wrapper nor process-wide, not
        compiled (``model.compile()``) and not being traced (``torch.jit.trace``), run :meth:`forward`'s work directly.

        Two Python frames shorter on every step, about a quarter of the instructions the wrapper adds to a tiny
        model's step; anything else goes through ``nn.Module.__call__`` as before.
        """
        if (
            self._compiled_call_impl is None
            and not (self._forward_pre_hooks or self._forward_hooks or self._backward_pre_hooks or self._backward_hooks)
            and not any(_GLOBAL_CALL_HOOKS)
            and not _tracing_state()
        ):
            if self._strategy.precision.forward_is_identity:
                return self._forward_call(*args, **kwargs)
            return self._run(self._forward_call, args, kwargs)
        return super().__call__(*args, **kwargs)

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(self._forward_call, args, kwargs)

    def _run(self, call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        precision = self._strategy.precision
        if precision.forward_is_identity:
            return call(*args, **kwargs)
        args, kwargs = precision.convert_input((args, kwargs))
        with precision.forward_context():
            output = call(*args, **kwargs)
        output = precision.convert_output(output)
        if precision.requires_fabric_backward and self.training:
            _guard_backward(output, self._strategy)
        return output

    def release_strategy_wrapper(self) -> None:
        """Forward straight to the original module from now on, dropping e.g. the DDP wrapper (at exit)."""
        self._forward_module = self._original_module
        self.__dict__["_forward_call"] = self._original_module
        self._refuse_unmarked = False

    def mark_forward_method(self, method: str | Callable[..., Any]) -> None:
        """Run calls of another method (e.g. ``training_step``, ``generate``) like ``forward``: through the
        strategy's wrapper (so DDP synchronises their gradients, FSDP gathers the parameters) and under
        the precision plugin."""
        name = method if isinstance(method, str) else method.__name__
        if name == "forward":
            raise ValueError("forward always runs through the strategy; mark other methods, e.g. 'training_step'.")
        if not callable(getattr(self._original_module, name, None)):
            raise AttributeError(f"{type(self._original_module).__name__} has no method {name!r} to mark.")
        self._forward_methods.add(name)

    def _call_marked(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with forward_redirected(self._original_module, name):
            return self._run(self._forward_call, args, kwargs)

    def _refuse_unmarked_call(self, method: Callable[..., Any], called: nn.Module) -> NoReturn:
        original = self._original_module
        name = method.__name__
        paths = [path for path, submodule in original.named_modules() if submodule is called]
        what = "the module" if called is original else f"submodule {paths[0]!r} ({type(called).__name__})"
        raise RuntimeError(
            f"{method.__qualname__}() ran {what} outside {type(self._strategy).__name__}'s wrapper: its gradients "
            "would not be synchronised across processes (or its sharded parameters not gathered). Mark the method "
            f"after setup with `fabric.mark_forward_method(model, {name!r})` (or "
            f"`model.mark_forward_method({name!r})`) so that it runs through the wrapper like forward."
        )

    # ``state_dict`` and friends act on the original module so checkpoints carry no wrapper prefix.
    @override
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The original module's state dict, as the strategy presents it (full tensors under ZeRO-3)."""
        return self._strategy.module_state_dict(self._original_module, *args, **kwargs)

    @override
    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load into the original module; a module built with ``empty_init=True`` may run from then on."""
        result = self._original_module.load_state_dict(state_dict, strict=strict, assign=assign)
        self._strategy.module_loaded(self._original_module)
        return result

    def __getitem__(self, index: Any) -> Any:
        """``model[0]`` on a set-up ``nn.Sequential`` (or ``ModuleList``, ``ModuleDict``): the wrapped module's item,
        as ``model.layer`` gives its attribute; ``for layer in model`` works through it too."""
        try:
            return self._original_module[index]  # type: ignore[index]
        except TypeError as error:
            raise TypeError(f"{error} (FabricModule indexes the module it wraps, `model.module`)") from error

    def __len__(self) -> int:
        """``len(model)``: the wrapped module's length (a ``Sequential``'s layers)."""
        try:
            return len(self._original_module)  # type: ignore[arg-type]
        except TypeError as error:
            raise TypeError(f"{error} (FabricModule measures the module it wraps, `model.module`)") from error

    def __bool__(self) -> bool:
        return True  # a module is truthy, whatever its length (``if model:`` never calls ``__len__``)

    def __getattr__(self, name: str) -> Any:
        # Our own submodules (``_forward_module``, ``_original_module``; the wrapper has no parameters or buffers).
        # Looked up without ``nn.Module.__getattr__``, whose AttributeError for every user attribute (``model.loss``
        # each step) costs more than the rest of the lookup.
        attributes = self.__dict__  # read once: every attribute read on a module takes the slow generic path
        own = attributes.get("_modules")
        if own is None:  # during ``nn.Module.__init__``
            return super().__getattr__(name)
        if name in own:
            return own[name]
        original = own.get("_original_module")
        if original is None:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r} (it is not set up yet)")
        attribute = getattr(original, name)
        if name in attributes.get("_forward_methods", ()):
            return functools.wraps(attribute)(lambda *args, **kwargs: self._call_marked(name, args, kwargs))
        if attributes.get("_refuse_unmarked") and inspect.ismethod(attribute):
            return self._guarded(attribute)
        return attribute

    def _guarded(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """``method`` (unmarked), refusing to run the module's parameters past the strategy's wrapper."""
        original = self._original_module

        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            with parameter_calls_refused(original, lambda called: self._refuse_unmarked_call(method, called)):
                return method(*args, **kwargs)

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        # Before __init__ finished, or for our own attributes, behave like a normal module; otherwise
        # set attributes the original module has on the original (``model.flag = True`` reaches it).
        original = self.__dict__.get("_modules", {}).get("_original_module")
        if original is None or name.startswith("_") or name in self.__dict__ or not hasattr(original, name):
            super().__setattr__(name, value)
        else:
            setattr(original, name, value)


def _guard_backward(output: Any, strategy: Strategy) -> None:
    """Make ``loss.backward()`` fail loudly when it must go through ``fabric.backward(loss)``."""

    def check(grad: torch.Tensor) -> torch.Tensor:
        if not strategy.backward_in_progress:
            raise RuntimeError(
                f"Call `fabric.backward(loss)` instead of `loss.backward()`: with precision="
                f"{strategy.precision.name!r} the loss must be scaled by Fabric, or the optimizer would step on "
                "wrongly scaled gradients."
            )
        return grad

    def guard(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.requires_grad:
            tensor.register_hook(check)  # type: ignore[no-untyped-call]
        return tensor

    apply_to_collection(output, torch.Tensor, guard)


class FabricOptimizer(SetUpByFabric):
    """Mixin for the class :func:`wrap_optimizer` builds. Holds no state of its own: the instance shares
    its ``__dict__`` with the user's optimizer, and the per-wrapper class holds the original and the
    strategy."""

    _fabric_original: Optimizer
    _fabric_strategy: Strategy
    #: The ``step`` a learning-rate scheduler installed (see :attr:`step`). None here, found by every lookup: a
    #: missing class attribute would cost an AttributeError raised and caught on every step.
    _fabric_scheduler_step: ClassVar[Callable[..., Any] | None] = None

    @property
    def optimizer(self) -> Optimizer:
        """The user's own optimizer."""
        return self._fabric_original

    @property
    def step(self) -> Callable[..., Any]:
        """Fabric's step (through the strategy and precision: DeepSpeed's engine, a GradScaler).

        A data descriptor, so it wins over the ``step`` that a learning-rate scheduler built *before*
        ``setup`` stored in the ``__dict__`` this wrapper shares: that one steps the user's optimizer
        directly, which would bypass the strategy silently.
        """
        return type(self)._fabric_scheduler_step or self._fabric_step

    @step.setter
    def step(self, value: Callable[..., Any]) -> None:
        # A scheduler built on this wrapper replaces ``step`` with a wrapper of ours that counts calls. Kept on
        # our class: in the shared ``__dict__`` it would also shadow the original's own ``step`` and recurse.
        type(self)._fabric_scheduler_step = staticmethod(value)

    def _fabric_step(self, closure: Callable[[], Any] | None = None) -> Any:
        strategy = self._fabric_strategy
        # Decided at every call (the Trainer may swap the precision after set-up): where neither the strategy nor
        # its precision changes how an optimizer steps, step it here, two calls shorter.
        if strategy.optimizer_step_is_plain and strategy.precision.optimizer_step_is_plain:
            return self._fabric_original.step() if closure is None else self._fabric_original.step(closure)
        return strategy.optimizer_step(self._fabric_original, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        strategy = self._fabric_strategy
        if strategy.optimizer_zero_grad_is_plain:  # as in _fabric_step: a call shorter
            self._fabric_original.zero_grad(set_to_none)
        else:
            strategy.optimizer_zero_grad(self._fabric_original, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._fabric_strategy.get_optimizer_state(self._fabric_original)


def wrap_optimizer(optimizer: OptimizerT, strategy: Strategy) -> OptimizerT:
    """An object that is an instance of ``type(optimizer)``, shares all of its state, and steps via Fabric."""
    cls = type(optimizer)
    wrapper_class = type(
        f"Fabric{cls.__name__}",
        (FabricOptimizer, cls),
        {"_fabric_original": optimizer, "_fabric_strategy": strategy},
    )
    wrapped: OptimizerT = object.__new__(wrapper_class)
    object.__setattr__(wrapped, "__dict__", optimizer.__dict__)
    return wrapped


def unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    """The user's optimizer behind Fabric's wrapper (what a GradScaler tracks), or ``optimizer`` itself."""
    return optimizer.optimizer if isinstance(optimizer, FabricOptimizer) else optimizer


class FabricDataLoader(SetUpByFabric):
    """Mixin for the class :func:`wrap_dataloader` builds: a copy of the user's ``DataLoader`` (still an
    instance of its class) that moves each batch to the device and advances the sampler's epoch."""

    _fabric_device: torch.device | None
    _fabric_epoch: int

    @property
    def device(self) -> torch.device | None:
        """Where batches are moved to; ``None`` when they are yielded as they are."""
        return self._fabric_device

    def __iter__(self) -> Iterator[Any]:
        # A new pass over the data: let distributed samplers reshuffle differently (and identically on
        # every rank) each epoch.
        for sampler in (getattr(self, "sampler", None), getattr(getattr(self, "batch_sampler", None), "sampler", None)):
            if callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(self._fabric_epoch)  # type: ignore[union-attr]
        self._fabric_epoch += 1
        batches = super().__iter__()  # type: ignore[misc]
        device = self._fabric_device
        if device is None:
            yield from batches
            return
        for batch in batches:
            yield move_data_to_device(batch, device)

    def __reduce__(self) -> tuple[Callable[..., DataLoader[Any]], tuple[Any, ...]]:
        """Pickle as the user's loader (its class and attributes) and the device: the class that
        :func:`wrap_dataloader` built exists only in this process, so unpickling builds it anew. This is what
        ``fabric.save(path, {"train_dataloader": loader})`` writes for a loader without ``state_dict()``, as
        Lightning does (a loader with one contributes its state instead)."""
        user_class = type(self).__bases__[1]
        return _rebuild_dataloader, (user_class, dict(self.__dict__), self._fabric_device)


def _rebuild_dataloader(
    loader_class: type[DataLoader[Any]], attributes: dict[str, Any], device: torch.device | None
) -> DataLoader[Any]:
    """The set-up loader a pickled :class:`FabricDataLoader` describes (see its ``__reduce__``)."""
    loader: DataLoader[Any] = object.__new__(loader_class)
    object.__setattr__(loader, "__dict__", attributes)
    return wrap_dataloader(loader, device, share_state=True)


def wrap_dataloader(
    dataloader: DataLoader[Any], device: torch.device | None, share_state: bool = False
) -> DataLoader[Any]:
    """An object of a subclass of the loader's own class whose batches arrive on ``device``.

    With ``share_state`` it shares the loader's attributes (``__dict__``), so what the loader records while
    iterating (a streaming loader's samples yielded, its ``state_dict()``) is current on the user's object
    too; otherwise it holds a copy of them (the loader was re-sharded into a copy already). CPU batches are
    already where they need to be, so on CPU the per-batch traversal is skipped.
    """
    if not isinstance(dataloader, DataLoader):
        raise TypeError(
            f"setup_dataloaders() expects torch.utils.data.DataLoader objects, got {type(dataloader).__name__}."
        )
    cls = type(dataloader)
    wrapper_class = type(
        f"Fabric{cls.__name__}",
        (FabricDataLoader, cls),
        {"_fabric_device": device if device is not None and device.type != "cpu" else None},
    )
    wrapped: DataLoader[Any] = object.__new__(wrapper_class)
    attributes = dataloader.__dict__ if share_state else dict(dataloader.__dict__)
    attributes.setdefault("_fabric_epoch", 0)
    object.__setattr__(wrapped, "__dict__", attributes)
    return wrapped
