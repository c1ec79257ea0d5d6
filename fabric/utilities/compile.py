"""``torch.compile`` and set-up modules: take a compiled module apart, and compile again around the
strategy's wrapper, so DDP/FSDP hooks stay outside the compiled graph and checkpoint keys carry no
``_orig_mod.`` prefix.

Nothing here imports ``torch._dynamo`` unless compilation is asked for: a compiled module implies it
is loaded already.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from torch import nn

#: What ``fabric.setup(model, compile=...)`` accepts: ``True`` or the keyword arguments of ``torch.compile``.
CompileArg = bool | Mapping[str, Any] | None
Compiler = Callable[["nn.Module"], "nn.Module"]


def uncompiled(module: nn.Module) -> tuple[nn.Module, Compiler | None]:
    """The module ``torch.compile`` wrapped, and a function compiling another module with the same settings
    (backend, mode, ``fullgraph``, ``dynamic``); ``(module, None)`` for a module that is not compiled."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None or not isinstance(module, dynamo.OptimizedModule):
        return module, None
    original: nn.Module = module._orig_mod
    compiler: Compiler = module.dynamo_ctx  # calling the context on a module is what torch.compile does
    return original, compiler


def compiler_for(compile: CompileArg) -> Compiler | None:
    """``torch.compile`` with the arguments ``compile`` gives, or ``None`` for ``compile=False``/``None``."""
    if compile is None or compile is False:
        return None
    if compile is not True and not isinstance(compile, Mapping):
        raise TypeError(
            f"compile={compile!r} is not valid. Accepted: True, False, or a dict of torch.compile arguments."
        )
    arguments = {} if compile is True else dict(compile)

    def compiler(module: nn.Module) -> nn.Module:
        import torch

        # torch-workaround(compile-warns-about-itself): torch.compile warns about its own use of torch.jit
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="`torch.jit.script_method` is deprecated", category=DeprecationWarning
            )
            return cast("nn.Module", torch.compile(module, **arguments))  # an OptimizedModule

    return compiler
