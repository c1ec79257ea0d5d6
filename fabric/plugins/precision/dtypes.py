"""The one map from a precision's canonical name to the floating-point dtype it computes in.

Precision plugins, DeepSpeed's precision and FSDP's mixed-precision policy all read it, so a name
means the same dtype everywhere.
"""

from __future__ import annotations

import torch

#: Compute dtype by canonical precision name (``"*-mixed"``: the autocast dtype; parameters stay float32).
PRECISION_DTYPES: dict[str, torch.dtype] = {
    "32-true": torch.float32,
    "64-true": torch.float64,
    "16-mixed": torch.float16,
    "bf16-mixed": torch.bfloat16,
    "fp8-mixed": torch.bfloat16,  # float8 matmuls in the converted Linear layers, bfloat16 autocast around them
    "16-true": torch.float16,
    "bf16-true": torch.bfloat16,
}


def mixed_dtype(name: str) -> torch.dtype | None:
    """The half dtype a ``"*-mixed"`` precision computes in, or None for any other precision."""
    return PRECISION_DTYPES.get(name) if name.endswith("-mixed") else None
