"""Precision plugins and the one place where precision strings are parsed (``PRECISION_REGISTRY``)."""

from __future__ import annotations

from fabric.plugins.precision.double import DoublePrecision
from fabric.plugins.precision.half import HalfPrecision
from fabric.plugins.precision.mixed import MixedPrecision
from fabric.plugins.precision.precision import Precision
from fabric.utilities.registry import Registry

PRECISION_REGISTRY: Registry[Precision] = Registry("precision")
PRECISION_REGISTRY.register("32-true", Precision, aliases=("32", "fp32"), description="float32 parameters and compute")
PRECISION_REGISTRY.register("64-true", DoublePrecision, aliases=("64",), description="float64 parameters and compute")
PRECISION_REGISTRY.register(
    "16-mixed",
    MixedPrecision,
    aliases=("16", "amp_fp16"),
    description="float32 parameters, float16 autocast, loss scaling",
    precision="16-mixed",
)
PRECISION_REGISTRY.register(
    "bf16-mixed",
    MixedPrecision,
    aliases=("bf16", "amp_bf16"),
    description="float32 parameters, bfloat16 autocast",
    precision="bf16-mixed",
)
PRECISION_REGISTRY.register("16-true", HalfPrecision, description="float16 parameters and compute", precision="16-true")
PRECISION_REGISTRY.register(
    "bf16-true", HalfPrecision, description="bfloat16 parameters and compute", precision="bf16-true"
)


def parse_precision(precision: str | int) -> str:
    """The canonical name (``"bf16-mixed"``, ...) for any accepted spelling, including ints like ``16``."""
    if isinstance(precision, bool) or not isinstance(precision, (str, int)):
        raise ValueError(
            f"Unknown precision {precision!r}. Accepted values: {', '.join(map(repr, PRECISION_REGISTRY.choices()))}."
        )
    return PRECISION_REGISTRY.canonical_name(str(precision))


__all__ = ["PRECISION_REGISTRY", "DoublePrecision", "HalfPrecision", "MixedPrecision", "Precision", "parse_precision"]
