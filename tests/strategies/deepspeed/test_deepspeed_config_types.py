"""DeepSpeed config values of the wrong type fail at ``Fabric(...)`` naming the key, the value and the expected
type (issue 15, item 7), instead of a raw TypeError, AttributeError or ZeroDivisionError from inside."""

from __future__ import annotations

from typing import Any

import pytest

from fabric import Fabric
from fabric.strategies.deepspeed import DeepSpeedStrategy


def _fabric(config: dict[str, Any]) -> Fabric:
    """Built and checked on 2 CPU processes; nothing launched, DeepSpeed not imported."""
    return Fabric(accelerator="cpu", devices=2, strategy=DeepSpeedStrategy(config=config))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"zero_optimization": "abc"},
            'zero_optimization="abc" (a string); expected an object (a dict), e.g. {"stage": 2}',
        ),
        ({"fp16": True}, 'fp16=true (a boolean); expected an object (a dict), e.g. {"enabled": true}'),
        ({"bf16": {"enabled": "yes"}}, 'bf16.enabled="yes" (a string); expected true or false'),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0 (an integer); expected a positive integer"),
        (
            {"train_batch_size": 16, "gradient_accumulation_steps": 0},
            "gradient_accumulation_steps=0 (an integer); expected a positive integer",
        ),
        ({"train_batch_size": "16"}, 'train_batch_size="16" (a string); expected a positive integer'),
        ({"train_micro_batch_size_per_gpu": 2.0}, "train_micro_batch_size_per_gpu=2.0 (a number); expected a positive"),
        ({"zero_optimization": {"stage": "2"}}, 'zero_optimization.stage="2" (a string); expected an integer, one of'),
        (
            {"zero_optimization": {"stage": 3, "offload_param": "cpu"}},
            'zero_optimization.offload_param="cpu" (a string); expected an object (a dict), e.g. {"device": "cpu"}',
        ),
        ({"gradient_clipping": None}, "gradient_clipping=null (null); expected a number >= 0"),
    ],
)
def test_a_value_of_the_wrong_type_names_key_value_and_expected_type(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="The DeepSpeed config sets ") as raised:
        _fabric(config)
    assert message in str(raised.value)


def test_values_of_the_right_types_are_accepted() -> None:
    config = {
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
        "bf16": {"enabled": False},
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1,
    }
    fabric = _fabric(config)
    assert fabric.strategy.config["gradient_accumulation_steps"] == 2
    assert fabric.strategy.config["zero_optimization"]["stage"] == 1
