"""The DeepSpeed config: read it, fill in what Fabric decides, and reject what contradicts Fabric.

Fabric's own settings (the ZeRO stage and offloading named by the strategy, the precision, the world
size) go into the config where it leaves them out. Where the config says something else, the job
fails at ``Fabric(...)`` with an error naming both, instead of DeepSpeed silently picking one.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

ConfigArg = dict[str, Any] | str | os.PathLike[str] | None

#: Fabric precision -> the DeepSpeed config section that enables it (``None``: full float32).
PRECISION_SECTIONS: dict[str, str | None] = {"32-true": None, "16-mixed": "fp16", "bf16-mixed": "bf16"}
ZERO_STAGES = (0, 1, 2, 3)
#: ZeRO stage when neither the strategy nor the config names one (DeepSpeed's own default is 0).
DEFAULT_STAGE = 2


def read_config(config: ConfigArg) -> dict[str, Any]:
    """A private copy of the config given as a dict or as the path of a JSON file."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"DeepSpeed config must be a dict or a path to a JSON file, got {type(config).__name__}.")
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config file {os.fspath(config)!r} does not exist.")
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"DeepSpeed config file {os.fspath(config)!r} is not valid JSON: {error}") from error
    if not isinstance(loaded, dict):
        raise ValueError(f"DeepSpeed config file {os.fspath(config)!r} holds a {type(loaded).__name__}, not an object.")
    return loaded


def check_stage(stage: int | None) -> None:
    if stage is not None and stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage={stage!r} is not supported. Accepted values: {list(ZERO_STAGES)}.")


def complete_config(
    config: dict[str, Any],
    *,
    stage: int | None,
    offload_optimizer: bool,
    offload_parameters: bool,
    precision: str,
    world_size: int,
) -> dict[str, Any]:
    """``config`` with Fabric's settings filled in; a ``ValueError`` naming both values on a contradiction."""
    check_types(config)
    config = copy.deepcopy(config)
    zero = config.setdefault("zero_optimization", {})
    stage = _settle_stage(zero, stage)
    if offload_parameters and stage != 3:
        raise ValueError(f"offload_parameters=True needs ZeRO stage 3, but the stage is {stage}.")
    if offload_optimizer:
        _settle_offload(zero, "offload_optimizer", stage)
    if offload_parameters:
        _settle_offload(zero, "offload_param", stage)
    _settle_precision(config, precision)
    if "gradient_accumulation_steps" not in config and "managed_gradient_accumulation" not in config:
        # Fabric's loop decides when to step (optimizer.step()); DeepSpeed must not count micro-batches.
        config["gradient_accumulation_steps"] = 1
        config["managed_gradient_accumulation"] = False
    _check_batch_sizes(config, world_size)
    config.setdefault("gradient_clipping", 0.0)  # DeepSpeed clips at norm 1.0 by default; Fabric only on request
    # Fabric users bring any torch optimizer; DeepSpeed otherwise refuses untested ones under ZeRO and
    # insists on its own CPU Adam when offloading.
    config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("zero_force_ds_cpu_optimizer", False)
    return config


#: Keys whose value must be a JSON object, with an example of one.
_SECTIONS = {
    "zero_optimization": '{"stage": 2}',
    "fp16": '{"enabled": true}',
    "bf16": '{"enabled": true}',
    "zero_optimization.offload_optimizer": '{"device": "cpu"}',
    "zero_optimization.offload_param": '{"device": "cpu"}',
}
#: Keys whose value must be a positive integer.
_POSITIVE_INTS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def check_types(config: dict[str, Any]) -> None:
    """Fail naming the key, its value and the expected type where DeepSpeed (or Fabric) would fail obscurely."""
    for key, example in _SECTIONS.items():
        found, value = _lookup(config, key)
        if found and not isinstance(value, dict):
            _wrong_type(key, value, f"an object (a dict), e.g. {example}")
    for section in ("fp16", "bf16"):
        found, value = _lookup(config, f"{section}.enabled")
        if found and not isinstance(value, bool):
            _wrong_type(f"{section}.enabled", value, "true or false")
    for key in _POSITIVE_INTS:
        found, value = _lookup(config, key)
        if found and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            _wrong_type(key, value, "a positive integer")
    found, value = _lookup(config, "zero_optimization.stage")
    if found and (isinstance(value, bool) or not isinstance(value, int)):
        _wrong_type("zero_optimization.stage", value, f"an integer, one of {list(ZERO_STAGES)}")
    found, value = _lookup(config, "gradient_clipping")
    if found and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
        _wrong_type("gradient_clipping", value, "a number >= 0 (0 turns clipping off)")


def _lookup(config: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    """``(True, value)`` for a key (``"a.b"`` inside section ``a``) the config sets, else ``(False, None)``."""
    value: Any = config
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _wrong_type(key: str, value: Any, expected: str) -> None:
    raise ValueError(
        f"The DeepSpeed config sets {key}={json.dumps(value, default=repr)} ({_json_type(value)}); expected {expected}."
    )


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def with_micro_batch_size(config: dict[str, Any], batch_size: int | None) -> dict[str, Any]:
    """Fill the per-rank batch size (from the dataloader Fabric set up, else 1) unless the config sets one.

    DeepSpeed uses it for throughput reports and batch-size-based schedulers; Fabric's loop decides the
    real batches.
    """
    if "train_micro_batch_size_per_gpu" in config or "train_batch_size" in config:
        return config
    return {**config, "train_micro_batch_size_per_gpu": batch_size or 1}


def zero_stage(config: dict[str, Any]) -> int:
    stage: int = config.get("zero_optimization", {}).get("stage", 0)
    return stage


def _settle_stage(zero: dict[str, Any], stage: int | None) -> int:
    if "stage" not in zero:
        zero["stage"] = DEFAULT_STAGE if stage is None else stage
    elif stage is not None and zero["stage"] != stage:
        raise ValueError(
            f"The DeepSpeed config sets zero_optimization.stage={zero['stage']!r}, but the strategy asks for "
            f"stage {stage}. Remove one of the two (strategy='deepspeed' takes the stage from the config)."
        )
    check_stage(zero["stage"])
    settled: int = zero["stage"]
    return settled


def _settle_offload(zero: dict[str, Any], section: str, stage: int) -> None:
    if stage < 2 and section == "offload_optimizer":
        raise ValueError(f"Offloading the optimizer needs ZeRO stage 2 or 3, but the stage is {stage}.")
    device = zero.setdefault(section, {}).setdefault("device", "cpu")
    if device not in ("cpu", "nvme"):
        raise ValueError(
            f"The strategy offloads ({section}), but the DeepSpeed config sets zero_optimization.{section}.device="
            f"{device!r}. Use 'cpu' or 'nvme', or a strategy without offloading."
        )


def _settle_precision(config: dict[str, Any], precision: str) -> None:
    if precision not in PRECISION_SECTIONS:
        raise ValueError(
            f"precision={precision!r} is not supported with DeepSpeed (it keeps float32 master weights for half "
            f"precision). Accepted values: {list(PRECISION_SECTIONS)}."
        )
    wanted = PRECISION_SECTIONS[precision]
    for section in ("fp16", "bf16"):
        enabled = config.get(section, {}).get("enabled")
        if enabled is None:
            continue
        if bool(enabled) != (section == wanted):
            state = "enables" if enabled else "disables"
            raise ValueError(
                f"The DeepSpeed config {state} {section} ({section}.enabled={enabled!r}), but Fabric's precision is "
                f"{precision!r}. Make them agree: precision='{_precision_for(section) if enabled else '32-true'}' or "
                "remove the section from the config."
            )
    if wanted is not None:
        config.setdefault(wanted, {})["enabled"] = True


def precision_from_config(config: dict[str, Any]) -> str | None:
    """The Fabric precision whose section (``fp16``/``bf16``) the config enables; ``None`` when it enables none."""
    sections = {section: config.get(section) for section in ("fp16", "bf16")}
    # A section of the wrong type is left to complete_config, whose error names the key and the expected type.
    enabled = [section for section, value in sections.items() if isinstance(value, dict) and value.get("enabled")]
    if len(enabled) > 1:
        raise ValueError("The DeepSpeed config enables both fp16 and bf16; enable one of them.")
    return _precision_for(enabled[0]) if enabled else None


def _precision_for(section: str) -> str:
    return next(name for name, enabling in PRECISION_SECTIONS.items() if enabling == section)


def _check_batch_sizes(config: dict[str, Any], world_size: int) -> None:
    """DeepSpeed requires train_batch_size = micro batch size x accumulation steps x world size."""
    total = config.get("train_batch_size")
    micro = config.get("train_micro_batch_size_per_gpu")
    accumulation = config.get("gradient_accumulation_steps", 1)
    if total is None:
        return
    expected = None if micro is None else micro * accumulation * world_size
    if (expected is not None and total != expected) or total % (accumulation * world_size):
        raise ValueError(
            f"The DeepSpeed config's train_batch_size={total} does not equal train_micro_batch_size_per_gpu="
            f"{micro} x gradient_accumulation_steps={accumulation} x Fabric's world size {world_size}."
        )
