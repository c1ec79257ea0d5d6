"""``PRECISION_REGISTRY`` and :func:`parse_precision`: the one place precision strings are parsed.

Targets are named lazily, so the CLI can list and validate precisions without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric.utilities.registry import Registry, unknown_choice

if TYPE_CHECKING:
    from fabric.plugins.precision.precision import Precision

_BASE = "fabric.plugins.precision.precision:Precision"
_DOUBLE = "fabric.plugins.precision.double:DoublePrecision"
_MIXED = "fabric.plugins.precision.mixed:MixedPrecision"
_HALF = "fabric.plugins.precision.half:HalfPrecision"

PRECISION_REGISTRY: Registry[Precision] = Registry("precision")
PRECISION_REGISTRY.register("32-true", _BASE, aliases=("32", "fp32"), description="float32 parameters and compute")
PRECISION_REGISTRY.register("64-true", _DOUBLE, aliases=("64",), description="float64 parameters and compute")
PRECISION_REGISTRY.register(
    "16-mixed",
    _MIXED,
    aliases=("16", "amp_fp16"),
    description="float32 parameters, float16 autocast, loss scaling",
    precision="16-mixed",
)
PRECISION_REGISTRY.register(
    "bf16-mixed",
    _MIXED,
    aliases=("bf16", "amp_bf16"),
    description="float32 parameters, bfloat16 autocast",
    precision="bf16-mixed",
)
PRECISION_REGISTRY.register(
    "fp8-mixed",
    "fabric.plugins.precision.float8:Float8Precision",
    aliases=("fp8", "amp_fp8"),
    description="float8 matmuls in the Linear layers (torchao), bfloat16 autocast elsewhere",
)
PRECISION_REGISTRY.register("16-true", _HALF, description="float16 parameters and compute", precision="16-true")
PRECISION_REGISTRY.register("bf16-true", _HALF, description="bfloat16 parameters and compute", precision="bf16-true")


def parse_precision(precision: str | int) -> str:
    """The canonical name (``"bf16-mixed"``, ...) for any accepted spelling, including ints like ``16``."""
    if isinstance(precision, bool) or not isinstance(precision, (str, int)):
        raise unknown_choice("precision", precision, PRECISION_REGISTRY.choices())
    return PRECISION_REGISTRY.canonical_name(str(precision))
