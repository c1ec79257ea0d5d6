"""``BitsandbytesPrecision``: Lightning's 4- and 8-bit quantized weights through bitsandbytes (QLoRA).

Not provided yet. The class exists so that programs written for Lightning Fabric that check
``isinstance(fabric.strategy.precision, BitsandbytesPrecision)`` (litgpt does, whether or not it quantizes) run;
making one raises a one-line error: on a machine without CUDA, that bitsandbytes needs a CUDA GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from fabric.plugins.precision.precision import Precision

#: Lightning's quantization modes.
MODES = ("nf4", "nf4-dq", "fp4", "fp4-dq", "int8", "int8-training")


class BitsandbytesPrecision(Precision):
    """Refuses to be made (see the module docstring), after checking ``mode`` against Lightning's modes."""

    def __init__(self, mode: str, dtype: torch.dtype | None = None, ignore_modules: Any = None) -> None:
        if mode not in MODES:
            raise ValueError(f"BitsandbytesPrecision(mode={mode!r}) is not a mode; accepted: {list(MODES)}.")
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"BitsandbytesPrecision(mode={mode!r}) quantizes weights with bitsandbytes, which needs a CUDA GPU; "
                "this machine has none. Train without quantization (litgpt: leave out --quantize)."
            )
        raise NotImplementedError(
            f"BitsandbytesPrecision(mode={mode!r}): 4/8-bit quantized weights are not provided by torch-fabric yet. "
            "Train without quantization (litgpt: leave out --quantize), or with precision='bf16-true'."
        )
