"""``BitsandbytesPrecision``: Lightning's 4- and 8-bit quantized Linear weights through bitsandbytes (QLoRA, litgpt's
``--quantize bnb.*``).

Every ``nn.Linear`` (outside ``ignore_modules``) becomes a bitsandbytes layer whose weight is quantized: NF4 or FP4
(4 bits per weight; the ``-dq`` modes also quantize the quantization constants) or int8 (LLM.int8). Quantized weights
are frozen: train adapters (LoRA) beside them. A full-precision state dict loads into a quantized model, each weight
quantized as it arrives, so a model built under ``fabric.init_module()`` never holds its full-precision weights at
once. It runs where bitsandbytes runs: CUDA GPUs, and CPUs (bitsandbytes >= 0.50; Lightning refuses CPUs).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from fabric.plugins.precision.half import ComputeDtypePrecision
from fabric.plugins.precision.precision import default_dtype
from fabric.utilities.lazy import install_hint
from fabric.utilities.rank_zero import rank_zero_warn

#: The quantization modes: the 4-bit ones as (bitsandbytes quant_type, quantized constants), and int8 (LLM.int8).
FOUR_BIT_MODES = {"nf4": ("nf4", False), "nf4-dq": ("nf4", True), "fp4": ("fp4", False), "fp4-dq": ("fp4", True)}
MODES = (*FOUR_BIT_MODES, "int8")


class BitsandbytesPrecision(ComputeDtypePrecision):
    """Quantize the Linear layers' weights to ``mode`` and compute in ``dtype`` (default: bfloat16 where CUDA
    supports it, else float16; the int8 modes need float16). ``ignore_modules``: names of submodules (prefixes)
    whose Linear layers stay as they are, e.g. ``{"lm_head"}``."""

    works_with_sharding = False

    def __init__(self, mode: str, dtype: torch.dtype | None = None, ignore_modules: set[str] | None = None) -> None:
        super().__init__(device_type="cuda" if torch.cuda.is_available() else "cpu")
        if mode == "int8-training":
            raise ValueError(
                "BitsandbytesPrecision(mode='int8-training'), int8 weights that train, is not provided: quantized "
                "weights are frozen here. Use mode='int8' and train adapters beside it, or precision='16-true'."
            )
        if mode not in MODES:
            raise ValueError(f"BitsandbytesPrecision(mode={mode!r}) is not a mode; accepted: {list(MODES)}.")
        if dtype is None:
            cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
            dtype = torch.bfloat16 if cuda_bf16 and not mode.startswith("int8") else torch.float16
        if mode.startswith("int8") and dtype is not torch.float16:
            raise ValueError(f"BitsandbytesPrecision(mode={mode!r}) computes in float16 only, not dtype={dtype}.")
        _bitsandbytes()
        self.mode, self.dtype = mode, dtype
        self.ignore_modules = set(ignore_modules or ())
        self.name = f"bitsandbytes-{mode}"

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Replace each Linear layer by a quantized one holding its weight and bias (one already quantized, e.g. built
        under ``fabric.init_module()``, stays) and keep the other floating-point tensors in the compute dtype."""
        if isinstance(module, nn.Linear):
            raise TypeError(
                "BitsandbytesPrecision quantizes the Linear layers inside a model, not a lone nn.Linear: wrap it in a "
                "module (e.g. nn.Sequential(layer))."
            )
        linear_layers = [(name, layer) for name, layer in module.named_modules() if isinstance(layer, nn.Linear)]
        if not linear_layers:
            raise TypeError(
                f"BitsandbytesPrecision quantizes Linear layers, and {type(module).__name__} has none: nothing would "
                "be quantized. Use another precision."
            )
        layer_class = quantized_linear_class(self.mode, self.dtype)
        frozen = []
        for name, layer in linear_layers:
            if isinstance(layer, layer_class) or self._ignored(name):
                continue
            if layer.weight.requires_grad:
                frozen.append(name)
            quantized: Any = layer_class(layer.in_features, layer.out_features, layer.bias is not None, device="meta")
            quantized.quantize_(layer.weight.detach(), layer.bias)
            parent_name, _, child = name.rpartition(".")
            setattr(module.get_submodule(parent_name), child, quantized)
        if frozen:
            rank_zero_warn(
                f"BitsandbytesPrecision quantized and froze the weights of {len(frozen)} Linear layer(s) that required "
                f"grad ({', '.join(frozen[:3])}{', ...' if len(frozen) > 3 else ''}): they no longer train. Train "
                "adapters beside them, or list the layers that should train in ignore_modules."
            )
        for submodule in module.modules():  # the rest computes in the dtype too, as when built under init_module()
            if isinstance(submodule, layer_class):
                continue
            for tensor in (*submodule.parameters(recurse=False), *submodule.buffers(recurse=False)):
                if tensor.is_floating_point():
                    tensor.data = tensor.data.to(self.dtype)
        return module

    def _ignored(self, name: str) -> bool:
        return any(name == prefix or name.startswith(f"{prefix}.") for prefix in self.ignore_modules)

    @override
    def module_init_context(self) -> AbstractContextManager[Any]:
        """Build Linear layers quantized from the start (``torch.nn.Linear`` is the quantized class in the block)."""
        if self.ignore_modules:
            raise ValueError(
                f"BitsandbytesPrecision(ignore_modules={sorted(self.ignore_modules)}) cannot build the model under "
                "fabric.init_module(): every Linear made there is quantized. Build it outside and let fabric.setup "
                "convert it, or leave ignore_modules out."
            )
        return _building_quantized(quantized_linear_class(self.mode, self.dtype), self.dtype)


@contextlib.contextmanager
def _building_quantized(layer_class: type[nn.Linear], dtype: torch.dtype) -> Iterator[None]:
    original = torch.nn.Linear
    torch.nn.Linear = layer_class  # type: ignore[misc]
    try:
        with default_dtype(dtype):
            yield
    finally:
        torch.nn.Linear = original  # type: ignore[misc]


def _bitsandbytes() -> Any:
    try:
        import bitsandbytes
    except ImportError as error:
        raise ModuleNotFoundError(
            f"BitsandbytesPrecision needs bitsandbytes: {install_hint('bitsandbytes', 'bitsandbytes')}."
        ) from error
    return bitsandbytes


@functools.cache
def quantized_linear_class(mode: str, compute_dtype: torch.dtype) -> type[nn.Linear]:
    """The bitsandbytes Linear layer of ``mode``, made like ``nn.Linear(in, out, bias, device, dtype)`` and loading
    full-precision weights (quantizing them as they arrive). One class per mode and dtype, made on first use because
    bitsandbytes is imported only then."""
    bnb = _bitsandbytes()
    four_bit = FOUR_BIT_MODES.get(mode)
    base = bnb.nn.Linear4bit if four_bit else bnb.nn.Linear8bitLt

    class QuantizedLinear(base):  # type: ignore[misc, valid-type]
        def __init__(
            self,
            in_features: int,
            out_features: int,
            bias: bool = True,
            device: torch.device | str | None = None,
            dtype: torch.dtype | None = None,
        ) -> None:
            if four_bit:
                quant_type, nested = four_bit
                base.__init__(
                    self,
                    in_features,
                    out_features,
                    bias,
                    compute_dtype=compute_dtype,
                    compress_statistics=nested,
                    quant_type=quant_type,
                    device=device,
                )
                # bitsandbytes 0.50 repacks a 4-bit weight, for good, for its AVX512-BF16 CPU kernel at the first
                # eval forward without gradients: a layer narrower than the quantization block (64) fails there
                # ("shape '[96, 0]' is invalid"), and training after that evaluation (a fine-tune that validates
                # or generates on the way) fails at the repacked layer's bias ("a view of a leaf Variable ... in an
                # in-place operation"). The general kernel serves both.
                self.support_avx512bf16_for_cpu = False
            else:
                base.__init__(self, in_features, out_features, bias, has_fp16_weights=False, device=device)
            if self.bias is not None:
                self.bias.data = self.bias.data.to(compute_dtype)
            if self.weight.device.type != "meta":
                self.quantize_(self.weight.data)

        def quantize_(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
            """Hold ``weight`` quantized (on its device; on the meta device it stays a placeholder) and ``bias``."""
            target = weight.device
            data = weight.detach().to(torch.float16 if not four_bit else compute_dtype)
            if four_bit:
                quant_type, nested = four_bit
                params = bnb.nn.Params4bit(
                    data, requires_grad=False, compress_statistics=nested, quant_type=quant_type, module=self
                )
            else:
                params = bnb.nn.Int8Params(data, requires_grad=False, has_fp16_weights=False)
            self.weight = params.to(target) if target.type != "meta" else params
            if isinstance(bias, nn.Parameter):  # the layer's own: kept, so that an optimizer holding it still trains it
                bias.data = bias.data.to(compute_dtype)
                self.bias = bias
            elif bias is not None:
                self.bias = nn.Parameter(bias.detach().to(target, compute_dtype), requires_grad=self.bias.requires_grad)

        def loadable_entries(self) -> dict[str, torch.Tensor]:
            """What a load takes for this layer: the full-precision weight (and bias), as the layer it replaces has
            them (:func:`fabric.utilities.checkpoint_state.loadable_state`)."""
            entries = {"weight": torch.empty(self.out_features, self.in_features, device="meta")}
            if self.bias is not None:
                entries["bias"] = torch.empty(self.out_features, device="meta")
            return entries

        @override
        def _load_from_state_dict(
            self,
            state_dict: dict[str, Any],
            prefix: str,
            local_metadata: dict[str, Any],
            strict: bool,
            missing_keys: list[str],
            unexpected_keys: list[str],
            error_msgs: list[str],
        ) -> None:
            weight = state_dict.get(f"{prefix}weight")
            if weight is None or tuple(weight.shape) != (self.out_features, self.in_features):  # not full precision
                super()._load_from_state_dict(
                    state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
                )
                return
            bias = state_dict.get(f"{prefix}bias")
            device = self.weight.device if self.weight.device.type != "meta" else weight.device
            self.quantize_(weight.to(device), bias.to(device) if bias is not None else None)

    QuantizedLinear.__name__ = QuantizedLinear.__qualname__ = f"QuantizedLinear_{mode.replace('-', '_')}"
    return QuantizedLinear
