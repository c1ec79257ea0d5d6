"""The precision plugin interface. The base class itself is full float32 precision (``"32-true"``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from torch import nn
from torch.optim import Optimizer

from fabric.utilities.inheritance import inherits_unchanged


class Precision:
    """Decides the dtype of parameters, inputs, outputs and compute, and how gradients are scaled.

    Every hook here is a no-op: that *is* ``"32-true"``. Subclasses override what they change.
    """

    name: str = "32-true"
    #: When True the module wrapper skips ``convert_input``, ``forward_context`` and ``convert_output``
    #: entirely, which keeps the per-step overhead of plain float32 training near zero.
    forward_is_identity: ClassVar[bool] = True
    #: When True, ``loss.backward()`` without ``fabric.backward(loss)`` would train wrongly (e.g. a
    #: GradScaler would see unscaled gradients), so the module wrapper guards against it.
    requires_fabric_backward: ClassVar[bool] = False
    #: When True, steps with inf/NaN gradients are skipped by the plugin (a GradScaler), so finding
    #: them while clipping is expected and not an error.
    skips_non_finite_steps: ClassVar[bool] = False
    #: When True, gradients carry the loss scale until ``unscale_gradients`` (a GradScaler), and the
    #: optimizer step goes through the scaler, which takes no closure.
    scales_gradients: ClassVar[bool] = False
    #: False when the plugin replaces whole layers in one process (quantized weights), which a strategy that shards
    #: parameters over ranks (FSDP, DeepSpeed) cannot take: such a pair is refused at ``Fabric(...)``.
    works_with_sharding: ClassVar[bool] = True
    #: Derived for each subclass: True when it overrides none of :meth:`pre_backward`, :meth:`backward` and
    #: :attr:`requires_fabric_backward`, so ``tensor.backward`` is called directly, two calls shorter on every step.
    #: An instance whose configuration makes its overrides no-ops says so itself (``bf16-mixed``: no loss scaler).
    backward_is_plain: bool = True
    #: Derived likewise: True when it does not override :meth:`optimizer_step`, so Fabric's optimizer wrapper
    #: steps the optimizer itself (and, as above, an instance may say so).
    optimizer_step_is_plain: bool = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.backward_is_plain = inherits_unchanged(
            cls, Precision, "pre_backward", "backward", "requires_fabric_backward"
        )
        cls.optimizer_step_is_plain = inherits_unchanged(cls, Precision, "optimizer_step")

    def __init__(self, *, device_type: str = "cpu") -> None:
        self.device_type = device_type

    def device_error(self, device_type: str) -> str | None:
        """Why this precision cannot run on ``device_type`` (one line naming both), or None when it can."""
        return None

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast the module's parameters/buffers to the dtype this precision keeps them in."""
        return module

    def module_init_context(self) -> AbstractContextManager[Any]:
        """Active while ``fabric.init_module()`` builds a module: e.g. sets the default dtype."""
        return self.tensor_init_context()

    def tensor_init_context(self) -> AbstractContextManager[Any]:
        """Active inside ``fabric.init_tensor()``."""
        return contextlib.nullcontext()

    def forward_context(self) -> AbstractContextManager[Any]:
        """Wraps every forward call of a set-up module (and ``fabric.autocast()``)."""
        return contextlib.nullcontext()

    def convert_input(self, data: Any) -> Any:
        """Cast floating-point inputs before the forward."""
        return data

    def convert_output(self, data: Any) -> Any:
        """Cast outputs to the dtype the user works in."""
        return data

    def pre_backward(self, tensor: torch.Tensor, module: nn.Module | None) -> torch.Tensor:
        """Return the tensor to call ``backward`` on (e.g. the loss multiplied by the loss scale)."""
        return tensor

    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        tensor.backward(*args, **kwargs)  # type: ignore[no-untyped-call]

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        return optimizer.step() if closure is None else optimizer.step(closure)

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Bring gradients to their true scale before they are inspected or clipped."""

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (e.g. the loss scale); empty when there is none."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    """Temporarily make ``dtype`` the default floating-point dtype for newly created tensors."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
