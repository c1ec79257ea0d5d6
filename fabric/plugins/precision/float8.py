"""``"fp8-mixed"``: float8 matmuls in the model's Linear layers, bfloat16 autocast elsewhere, on torchao.

torchao's float8 training (``torchao.float8``, PyPI ``torchao``, the extra ``fp8``) swaps each chosen ``nn.Linear``
for a ``Float8Linear`` that casts its input, weight and output gradient to float8 with dynamic scales and multiplies
them with ``torch._scaled_mm``; the parameters stay in float32 and the optimizer steps them there, so checkpoints are
the same as ``bf16-mixed``'s and load in any precision. Everything else runs under bfloat16 autocast, as in
``bf16-mixed``.

Which layers: by default every ``nn.Linear`` whose two dimensions are multiples of 16 (what the float8 kernels take)
except the last one in the model (the output head, whose logits float8 would coarsen); ``convert_head=True`` includes
it and ``module_filter(module, name)`` replaces the rule. Where it runs: CUDA GPUs of compute capability 8.9 or newer
(H100, H200, B200, L4, RTX 4090) and CPUs where ``torch._scaled_mm`` runs (torch >= 2.13); speed comes with
``torch.compile``, which fuses the casts (eager float8 is slower than bf16).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from fabric.plugins.precision.mixed import MixedPrecision
from fabric.utilities.lazy import install_hint

#: torchao's scaling recipes: one scale per tensor, one per row, rows with the weight gradient in high precision.
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: The float8 kernels take matrices whose dimensions are multiples of this.
FLOAT8_DIM_MULTIPLE = 16
#: The oldest CUDA compute capability with float8 tensor cores (Ada, then Hopper and later).
MIN_CUDA_CAPABILITY = (8, 9)

ModuleFilter = Callable[[nn.Module, str], bool]


class Float8Precision(MixedPrecision):
    """Train the chosen ``nn.Linear`` layers with float8 matmuls (torchao), the rest under bfloat16 autocast.

    ``recipe``: one of :data:`RECIPES`. ``module_filter(module, name)``: True for the layers to convert (replaces the
    default rule, see the module docstring). ``convert_head``: also convert the model's last Linear layer.
    ``fsdp_float8_all_gather``: under FSDP2, all-gather the converted weights in float8 (half the bytes of bf16;
    tensorwise recipe only).
    """

    def __init__(
        self,
        recipe: str = "tensorwise",
        *,
        module_filter: ModuleFilter | None = None,
        convert_head: bool = False,
        fsdp_float8_all_gather: bool = False,
        device_type: str = "cpu",
    ) -> None:
        super().__init__("bf16-mixed", device_type=device_type)
        if recipe not in RECIPES:
            raise ValueError(f"Float8Precision(recipe={recipe!r}) is not a recipe; accepted: {list(RECIPES)}.")
        if fsdp_float8_all_gather and recipe != "tensorwise":
            raise ValueError(
                f"Float8Precision(fsdp_float8_all_gather=True) works with recipe='tensorwise' only, not {recipe!r}."
            )
        if module_filter is not None and convert_head:
            raise ValueError(
                "Float8Precision: module_filter= decides every layer, the head included; convert_head=True would be "
                "ignored. Pass one of them."
            )
        self.name = "fp8-mixed"
        self.recipe = recipe
        self.module_filter = module_filter
        self.convert_head = convert_head
        self.fsdp_float8_all_gather = fsdp_float8_all_gather
        _torchao_float8()  # a missing torchao fails here, at Fabric(...), not at setup

    @override
    def device_error(self, device_type: str) -> str | None:
        if device_type == "cuda":
            capability = torch.cuda.get_device_capability()
            if capability < MIN_CUDA_CAPABILITY:
                return (
                    f"precision='fp8-mixed' needs float8 tensor cores (CUDA compute capability "
                    f"{'.'.join(map(str, MIN_CUDA_CAPABILITY))} or newer: H100, H200, B200, L4, RTX 4090); "
                    f"{torch.cuda.get_device_name()} has {'.'.join(map(str, capability))}. Use 'bf16-mixed'."
                )
            return None
        if device_type == "cpu":
            return (
                None
                if cpu_runs_float8()
                else (
                    f"precision='fp8-mixed' needs torch._scaled_mm on the CPU, which torch {torch.__version__} lacks "
                    "(torch >= 2.13 has it). Use 'bf16-mixed'."
                )
            )
        return f"precision='fp8-mixed' runs on CUDA GPUs and CPUs, not on {device_type!r}. Use 'bf16-mixed'."

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Swap the chosen Linear layers for torchao's ``Float8Linear`` (same parameter objects, so optimizers made
        before ``setup`` still hold them). Refuses a model in which nothing would be converted."""
        float8 = _torchao_float8()
        chosen = self.chosen_layers(module)
        if not chosen:
            raise ValueError(
                f"precision='fp8-mixed' converts nn.Linear layers, and none of {type(module).__name__}'s was chosen "
                f"({self._rule()}). Use precision='bf16-mixed', or pass Float8Precision(module_filter=...)."
            )
        self._check_shapes(module, chosen)
        config = float8.Float8LinearConfig.from_recipe_name(self.recipe)
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=self.fsdp_float8_all_gather)
        names = set(chosen)
        converted: nn.Module = float8.convert_to_float8_training(
            module, module_filter_fn=lambda _, name: name in names, config=config
        )
        return converted

    def chosen_layers(self, module: nn.Module) -> list[str]:
        """The qualified names of the Linear layers this precision converts in ``module``."""
        linears = [(name, layer) for name, layer in module.named_modules() if type(layer) is nn.Linear]
        if self.module_filter is not None:
            return [name for name, layer in linears if self.module_filter(layer, name)]
        head = None if self.convert_head or not linears else linears[-1][0]
        return [name for name, layer in linears if name != head and _float8_shape(layer)]

    def _rule(self) -> str:
        if self.module_filter is not None:
            return f"module_filter={getattr(self.module_filter, '__name__', self.module_filter)!r} chose none"
        head = "" if self.convert_head else ", except the last one (the output head)"
        return f"the rule: Linear layers with both dimensions multiples of {FLOAT8_DIM_MULTIPLE}{head}"

    @staticmethod
    def _check_shapes(module: nn.Module, chosen: list[str]) -> None:
        for name in chosen:
            layer = module.get_submodule(name)
            if isinstance(layer, nn.Linear) and not _float8_shape(layer):
                out_features, in_features = layer.weight.shape
                raise ValueError(
                    f"precision='fp8-mixed': layer {name!r} ({in_features} -> {out_features}) was chosen, but the "
                    f"float8 kernels need both dimensions to be multiples of {FLOAT8_DIM_MULTIPLE}; leave it out of "
                    "module_filter."
                )

    @override
    def __repr__(self) -> str:
        return f"{type(self).__name__}(recipe={self.recipe!r})"


def _float8_shape(layer: nn.Linear) -> bool:
    out_features, in_features = layer.weight.shape
    return out_features % FLOAT8_DIM_MULTIPLE == 0 and in_features % FLOAT8_DIM_MULTIPLE == 0


@functools.cache
def cpu_runs_float8() -> bool:
    """Whether ``torch._scaled_mm`` multiplies float8 matrices on this CPU (tried once on a 16x16 product)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    scale = torch.ones(())
    try:
        torch._scaled_mm(a, a.t(), scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


@functools.cache
def _torchao_float8() -> Any:
    """``torchao.float8``, imported on first use. torchao warns at import about its CUDA-only extensions that a CPU
    build cannot load; float8 training needs none of them, so those warnings are held back."""
    torchao_logger = logging.getLogger("torchao")
    level = torchao_logger.level
    torchao_logger.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    except ImportError as error:
        raise ModuleNotFoundError(
            f"precision='fp8-mixed' needs torchao's float8 training: {install_hint('fp8', 'torchao')}."
        ) from error
    finally:
        torchao_logger.setLevel(level)
    return float8
