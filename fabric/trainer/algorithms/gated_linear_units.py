"""GatedLinearUnits: the feed-forward block of each transformer layer becomes a gated linear unit (GLU).

Shazeer, "GLU Variants Improve Transformer" (2020): instead of ``W2 act(W1 x)``, the block computes
``W2 (act(W_gate x) * W_in x)`` (GEGLU with GELU, SwiGLU with SiLU, ...), which trains better for the same
width. Composer's method does this to BERT's intermediate/output modules of Hugging Face models; here the
supported pattern is PyTorch's own: ``nn.TransformerEncoderLayer`` and ``nn.TransformerDecoderLayer`` (and
subclasses keeping their feed-forward ``linear2(dropout(activation(linear1(x))))``). In each, ``linear1``
becomes a :class:`GatedLinearUnit` (the gated and the non-gated layer, both new, ``d_model -> dim_feedforward``)
and ``activation`` the identity; ``linear2``, dropout and the norms are kept. As in Composer, this adds
``d_model * dim_feedforward`` parameters per layer (shrink ``dim_feedforward`` to keep the count).

Composer's arguments: ``act_fn`` (a callable, or one of the names ``"relu"``, ``"gelu"``, ``"gelu_tanh"``,
``"silu"``, ``"sigmoid"``, ``"tanh"``, ``"mish"``; None: each layer's own activation), ``gated_layer_bias`` and
``non_gated_layer_bias`` (whether those layers have a bias). A model without such a layer is refused with a
``ValueError``; layers already converted are skipped.

Fires once, at ``Event.INIT``; optimizers get the new parameters in place of ``linear1``'s. PyTorch's fused
inference path (which would read ``linear1.weight`` directly) is turned off for the converted layers.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from fabric.trainer.algorithms.transformer_paths import disable_fused_transformer_paths
from fabric.trainer.surgery import SurgeryAlgorithm, update_params_in_optimizer

Activation = Callable[[torch.Tensor], torch.Tensor]

#: Activations by the names ``act_fn`` accepts (and checkpoints record).
ACTIVATIONS: dict[str, Activation] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "mish": F.mish,
}
_MODULE_NAMES: dict[type[nn.Module], str] = {
    nn.ReLU: "relu",
    nn.SiLU: "silu",
    nn.Sigmoid: "sigmoid",
    nn.Tanh: "tanh",
    nn.Mish: "mish",
}
_TRANSFORMER_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def activation_name(act_fn: Activation) -> str:
    """The name that :func:`resolve_activation` turns back into ``act_fn`` (a known name, or a dotted path)."""
    for name, known in ACTIVATIONS.items():
        if act_fn is known:
            return name
    if isinstance(act_fn, nn.GELU):
        return "gelu" if act_fn.approximate == "none" else "gelu_tanh"
    if isinstance(act_fn, nn.Module) and type(act_fn) in _MODULE_NAMES:
        return _MODULE_NAMES[type(act_fn)]
    module, qualname = getattr(act_fn, "__module__", None), getattr(act_fn, "__qualname__", None)
    if module and qualname and "<" not in qualname:
        return f"{module}.{qualname}"
    raise ValueError(
        f"GatedLinearUnits: act_fn={act_fn!r} has no name to record in a checkpoint; pass a function defined at "
        f"module level or one of {list(ACTIVATIONS)}."
    )


def resolve_activation(act_fn: str | Activation | None) -> Activation | None:
    """``act_fn`` as a callable: a name of :data:`ACTIVATIONS`, the dotted path of a function in an imported
    module (as :func:`activation_name` records it), or a callable (returned as is)."""
    if act_fn is None or not isinstance(act_fn, str):
        if act_fn is None or callable(act_fn):
            return act_fn
    elif act_fn in ACTIVATIONS:
        return ACTIVATIONS[act_fn]
    else:
        parts = act_fn.split(".")
        for split in range(len(parts) - 1, 0, -1):
            found: Any = sys.modules.get(".".join(parts[:split]))  # never import what a checkpoint names
            for part in parts[split:]:
                found = getattr(found, part, None)
            if found is not None and callable(found):
                return found  # type: ignore[no-any-return]
    raise ValueError(
        f"GatedLinearUnits: act_fn={act_fn!r} is not accepted: pass a callable, None (each layer's own activation), "
        f"one of {list(ACTIVATIONS)}, or the dotted path of a function in an imported module."
    )


class GatedLinearUnit(nn.Module):
    """``act_fn(gated_layer(x)) * non_gated_layer(x)``: the first half of a GLU feed-forward block."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        act_fn: Activation,
        gated_layer_bias: bool = False,
        non_gated_layer_bias: bool = False,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.gated_layer = nn.Linear(in_features, out_features, bias=gated_layer_bias, device=device, dtype=dtype)
        self.non_gated_layer = nn.Linear(
            in_features, out_features, bias=non_gated_layer_bias, device=device, dtype=dtype
        )
        self.act_fn = act_fn

    @override
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        gate: torch.Tensor = self.act_fn(self.gated_layer(input))
        value: torch.Tensor = self.non_gated_layer(input)
        return gate * value

    @override
    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, act_fn={self.act_fn!r}"


def _features(layer: nn.Module) -> tuple[int, int]:
    """``(d_model, dim_feedforward)`` of a transformer layer, whatever ``linear1`` has become."""
    linear1 = layer.get_submodule("linear1")
    d_model = int(layer.get_submodule("self_attn").embed_dim)  # type: ignore[arg-type]
    width = getattr(linear1, "out_features", None)
    if not isinstance(width, int):  # another surgery (Factorize) changed linear1: ask it
        parameter = next(linear1.parameters())
        with torch.no_grad():
            width = int(linear1(torch.zeros(1, d_model, device=parameter.device, dtype=parameter.dtype)).shape[-1])
    return d_model, width


def apply_gated_linear_units(
    model: nn.Module,
    optimizers: Sequence[Optimizer] = (),
    act_fn: str | Activation | None = None,
    gated_layer_bias: bool = False,
    non_gated_layer_bias: bool = False,
) -> list[str]:
    """Turn the feed-forward block of every ``nn.TransformerEncoderLayer``/``DecoderLayer`` of ``model`` into a
    GLU, in place (see the module docstring); returns the names of the converted layers.

    Raises ``ValueError`` when ``model`` has no such layer; ``optimizers`` get the new parameters.
    """
    activation = resolve_activation(act_fn)
    layers = [(name, module) for name, module in model.named_modules() if isinstance(module, _TRANSFORMER_LAYERS)]
    if not layers:
        present = sorted({type(module).__name__ for module in model.modules()})
        raise ValueError(
            "GatedLinearUnits supports the feed-forward blocks of torch.nn.TransformerEncoderLayer and "
            f"TransformerDecoderLayer (linear1 -> activation -> linear2); {type(model).__name__} has none (its module "
            f"classes are {present})."
        )
    converted = []
    for name, layer in layers:
        linear1 = layer.get_submodule("linear1")
        if isinstance(linear1, GatedLinearUnit):
            continue
        d_model, width = _features(layer)
        reference = next(linear1.parameters())
        layer_activation = activation if activation is not None else layer.activation
        glu = GatedLinearUnit(
            d_model,
            width,
            layer_activation,
            gated_layer_bias,
            non_gated_layer_bias,
            device=reference.device,
            dtype=reference.dtype,
        )
        update_params_in_optimizer(list(linear1.parameters()), list(glu.parameters()), optimizers)
        layer.register_module("linear1", glu)
        layer.activation = nn.Identity()
        converted.append(name)
    disable_fused_transformer_paths(model)  # they would read linear1.weight, which a GLU has not
    return converted


class GatedLinearUnits(SurgeryAlgorithm):
    """GLU feed-forward blocks in PyTorch transformer layers, set up at INIT (see the module docstring)."""

    def __init__(
        self,
        act_fn: str | Activation | None = None,
        gated_layer_bias: bool = False,
        non_gated_layer_bias: bool = False,
    ) -> None:
        self.act_fn = resolve_activation(act_fn)
        self._act_fn_name = None if self.act_fn is None else activation_name(self.act_fn)
        for name, value in (("gated_layer_bias", gated_layer_bias), ("non_gated_layer_bias", non_gated_layer_bias)):
            if not isinstance(value, bool):
                raise ValueError(f"GatedLinearUnits: {name}={value!r} must be True or False.")
        self.gated_layer_bias, self.non_gated_layer_bias = gated_layer_bias, non_gated_layer_bias

    @override
    def apply_surgery(self, model: nn.Module, optimizers: Sequence[Optimizer] = ()) -> None:
        converted = apply_gated_linear_units(
            model, optimizers, self.act_fn, self.gated_layer_bias, self.non_gated_layer_bias
        )
        if not converted:
            warnings.warn(
                f"GatedLinearUnits: every transformer layer of {type(model).__name__} is already gated.", stacklevel=2
            )

    @override
    def hparams(self) -> dict[str, Any]:
        return {
            "act_fn": self._act_fn_name,
            "gated_layer_bias": self.gated_layer_bias,
            "non_gated_layer_bias": self.non_gated_layer_bias,
        }
