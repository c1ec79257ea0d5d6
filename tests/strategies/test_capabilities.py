"""What the Trainer asks Fabric, strategies and precisions: capabilities, not class names."""

from __future__ import annotations

import pytest
import torch

from fabric import Fabric
from fabric.plugins.precision.mixed import MixedPrecision
from fabric.plugins.precision.precision import Precision
from fabric.strategies.ddp import DDPStrategy
from fabric.strategies.deepspeed import DeepSpeedStrategy
from fabric.strategies.fsdp import FSDPStrategy
from fabric.strategies.single_device import SingleDeviceStrategy
from fabric.trainer.trainer import Trainer
from fabric.wrappers import unwrap_optimizer


def test_only_spawn_and_fork_need_a_function_to_launch() -> None:
    assert DDPStrategy(start_method="spawn").launch_needs_function
    assert DDPStrategy(start_method="fork").launch_needs_function
    assert not DDPStrategy(start_method="popen").launch_needs_function
    assert not FSDPStrategy().launch_needs_function
    assert not SingleDeviceStrategy().launch_needs_function


def test_only_ddp_and_one_device_replicate_the_gradients() -> None:
    assert DDPStrategy().replicates_gradients
    assert SingleDeviceStrategy().replicates_gradients
    assert not FSDPStrategy().replicates_gradients
    assert not DeepSpeedStrategy().replicates_gradients


def test_only_deepspeed_keeps_the_gradients_in_its_engine() -> None:
    assert DeepSpeedStrategy().engine_handles_gradients
    assert not DDPStrategy().engine_handles_gradients
    assert not FSDPStrategy().engine_handles_gradients


def test_only_a_grad_scaler_scales_gradients() -> None:
    assert MixedPrecision("16-mixed").scales_gradients
    assert not MixedPrecision("bf16-mixed").scales_gradients
    assert not Precision().scales_gradients


def test_launched_turns_true_once_launch_ran() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    assert not fabric.launched
    fabric.launch()
    assert fabric.launched


def test_unwrap_optimizer_returns_the_users_optimizer() -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _, wrapped = Fabric(accelerator="cpu", devices=1).setup(model, optimizer)
    assert wrapped is not optimizer
    assert unwrap_optimizer(wrapped) is optimizer
    assert unwrap_optimizer(optimizer) is optimizer


def test_a_trainer_on_a_spawn_strategy_outside_launch_is_refused_before_starting_processes() -> None:
    model = torch.nn.Linear(2, 1)
    model.loss = lambda outputs, batch: outputs.sum()  # type: ignore[assignment]
    fabric = Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(start_method="spawn"))
    with pytest.raises(ValueError, match=r"DDPStrategy\(start_method='spawn', devices=2\) runs a function per process"):
        Trainer(model=model, fabric=fabric, progress_bar=False)


def test_auto_microbatching_on_several_ranks_is_refused_where_gradients_are_sharded() -> None:
    model = torch.nn.Linear(2, 1)
    model.loss = lambda outputs, batch: outputs.sum()  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"'auto' on several ranks needs strategy='ddp', got FSDPStrategy"):
        Trainer(model=model, accelerator="cpu", devices=2, strategy="fsdp", device_train_microbatch_size="auto")
