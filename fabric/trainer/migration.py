"""Composer's argument names that the Trainer accepts with Composer's meaning, without warnings.

* ``device="cpu" | "gpu" | "mps"``: the same as ``accelerator=`` (both given and disagreeing is an error).
* ``precision="amp"``: Composer's automatic mixed precision, float16 autocast with loss scaling, i.e.
  ``"16-mixed"`` (also spelled ``"amp_fp16"``). Composer refuses it on a CPU; here it runs float16 autocast
  on the CPU with a GradScaler (``"amp_bf16"`` is the CPU choice measured fast where the CPU has bfloat16
  instructions).
* ``deepspeed_config={...}``: train with the DeepSpeed strategy configured by that dict (``{}``: its defaults).
* ``load_path_format``: the same as ``load_path``.
* ``grad_accum=N``: split every batch into ``N`` microbatches, i.e. ``device_train_microbatch_size`` of the
  train dataloader's ``batch_size / N`` (which must divide); ``grad_accum="auto"`` is
  ``device_train_microbatch_size="auto"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_DEVICES = ("cpu", "gpu", "mps")
_GPU_ACCELERATORS = ("gpu", "cuda", "mps")


def translate_fabric_choices(
    choices: Mapping[str, Any], device: str | None, deepspeed_config: Mapping[str, Any] | None
) -> dict[str, Any]:
    """``choices`` (the Trainer's Fabric arguments) with ``device``, ``precision="amp"`` and ``deepspeed_config``
    turned into Fabric's ``accelerator``, ``precision`` and ``strategy``."""
    translated = dict(choices)
    if device is not None:
        translated["accelerator"] = _accelerator_for(device, choices.get("accelerator"))
    if translated.get("precision") == "amp":
        translated["precision"] = "16-mixed"
    if deepspeed_config is not None:
        translated["strategy"] = _deepspeed_strategy(deepspeed_config, choices.get("strategy"))
    return translated


def _accelerator_for(device: str, accelerator: Any) -> Any:
    if device not in _DEVICES:
        raise ValueError(
            f"device={device!r} is not valid. Accepted: {', '.join(map(repr, _DEVICES))} (Composer's name for "
            "accelerator=; Fabric's accelerator= takes more)."
        )
    if accelerator is None or accelerator == device:
        return device
    if device == "gpu" and accelerator in _GPU_ACCELERATORS:
        return accelerator  # the more precise of two names that agree
    raise ValueError(
        f"device={device!r} and accelerator={accelerator!r} disagree: device is Composer's name for accelerator. "
        "Pass only one of them."
    )


def _deepspeed_strategy(config: Mapping[str, Any], strategy: Any) -> Any:
    if not isinstance(config, Mapping):
        raise TypeError(f"deepspeed_config must be a dict (DeepSpeed's JSON config), got {type(config).__name__}.")
    if strategy not in (None, "auto", "deepspeed"):
        raise ValueError(
            f"deepspeed_config= selects the DeepSpeed strategy, but strategy={strategy!r} was given too. "
            "Pass only deepspeed_config= (or strategy=DeepSpeedStrategy(config=...))."
        )
    from fabric.strategies.deepspeed import DeepSpeedStrategy

    return DeepSpeedStrategy(config=dict(config))


def load_path_from(load_path: str | None, load_path_format: str | None) -> str | None:
    """``load_path``, or Composer's older name for it, ``load_path_format``; both given is an error."""
    if load_path_format is None:
        return load_path
    if load_path is not None and load_path != load_path_format:
        raise ValueError(
            f"load_path={load_path!r} and load_path_format={load_path_format!r} disagree: load_path_format is "
            "Composer's older name for load_path. Pass only one of them."
        )
    return load_path_format


def check_grad_accum(grad_accum: int | str | None, microbatch_size: int | str | None) -> int | str | None:
    """The ``device_train_microbatch_size`` to start with: ``"auto"`` for ``grad_accum="auto"``, else the given one.

    A numeric ``grad_accum`` is resolved per train dataloader by :func:`microbatch_size_for`.
    """
    if grad_accum is None:
        return microbatch_size
    if microbatch_size is not None:
        raise ValueError(
            f"grad_accum={grad_accum!r} and device_train_microbatch_size={microbatch_size!r} both set the "
            "microbatches: pass only one of them."
        )
    if grad_accum == "auto":
        return "auto"
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"grad_accum={grad_accum!r} must be a positive int (microbatches per batch) or 'auto'.")
    return None


def microbatch_size_for(grad_accum: int, dataloader: Any) -> int | None:
    """Samples per microbatch so a batch of the train dataloader runs as ``grad_accum`` microbatches."""
    size = getattr(dataloader, "batch_size", None)
    if isinstance(size, bool) or not isinstance(size, int):
        raise ValueError(
            f"grad_accum={grad_accum} splits each batch into {grad_accum} microbatches, which needs the train "
            f"dataloader's batch_size; this {type(dataloader).__name__} has none. Pass "
            "device_train_microbatch_size=<samples per microbatch> instead."
        )
    if size % grad_accum:
        raise ValueError(
            f"grad_accum={grad_accum} does not divide the train dataloader's batch_size={size}: the microbatches "
            f"would differ in size. Use a grad_accum that divides {size}, or device_train_microbatch_size=."
        )
    return None if grad_accum == 1 else size // grad_accum
