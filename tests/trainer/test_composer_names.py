"""Composer's argument names keep Composer's meaning (issue 13, item 8): ``device``, ``precision="amp"``,
``deepspeed_config``, ``load_path_format`` and ``grad_accum``, without warnings."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric
from fabric.accelerators.cpu import CPUAccelerator
from fabric.trainer.core.callback import Callback
from fabric.trainer.core.state import State
from fabric.trainer.migration import translate_fabric_choices
from fabric.trainer.trainer import Trainer

Batch = tuple[torch.Tensor, torch.Tensor]


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 1)

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.linear(batch[0])  # type: ignore[no-any-return]

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        return F.mse_loss(outputs.squeeze(-1), batch[1])


def _loader(batch_size: int = 8, batches: int = 2) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    samples = batch_size * batches
    return DataLoader(TensorDataset(torch.randn(samples, 4, generator=generator), torch.randn(samples)), batch_size)


def _trainer(**kwargs: Any) -> Trainer:
    model = Regressor()
    kwargs.setdefault("train_dataloader", _loader())
    return Trainer(model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1), progress_bar=False, seed=0, **kwargs)


class ForwardSizes(Callback):
    def __init__(self) -> None:
        self.sizes: list[int] = []

    def before_forward(self, state: State, logger: Any) -> None:
        self.sizes.append(int(state.batch[0].shape[0]))


# --- device -----------------------------------------------------------------------------------------


def test_device_is_composers_name_for_accelerator() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same meaning, no deprecation noise
        trainer = _trainer(device="cpu")
    assert isinstance(trainer.fabric.accelerator, CPUAccelerator)
    assert isinstance(_trainer(device="cpu", accelerator="cpu").fabric.accelerator, CPUAccelerator)


def test_device_and_accelerator_that_disagree_fail_naming_both() -> None:
    with pytest.raises(ValueError, match=r"device='gpu' and accelerator='cpu' disagree"):
        _trainer(device="gpu", accelerator="cpu")
    with pytest.raises(ValueError, match=r"device='tpu' is not valid\. Accepted: 'cpu', 'gpu', 'mps'"):
        _trainer(device="tpu")
    # "gpu" and a GPU accelerator agree; which one this machine lacks is Fabric's error, not a conflict
    assert translate_fabric_choices({"accelerator": "cuda"}, "gpu", None)["accelerator"] == "cuda"


# --- precision="amp" ---------------------------------------------------------------------------------


def test_amp_is_float16_mixed_precision_with_loss_scaling_also_on_cpu() -> None:
    trained = {}
    for precision in ("amp", "amp_fp16"):
        trainer = _trainer(precision=precision, max_duration="2ba")
        assert trainer.fabric.strategy.precision.dtype is torch.float16
        assert trainer.fabric.strategy.precision.scaler is not None
        trainer.fit()
        trained[precision] = trainer.state.model.module.linear.weight.detach().clone()
    assert torch.equal(trained["amp"], trained["amp_fp16"])


# --- deepspeed_config -------------------------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_config_becomes_the_deepspeed_strategy_with_that_config() -> None:
    from fabric.strategies.deepspeed import DeepSpeedStrategy

    config = {"zero_optimization": {"stage": 1}, "gradient_clipping": 0.5}
    choices = translate_fabric_choices({"accelerator": "cpu", "devices": 2}, None, config)
    fabric = Fabric(**choices)  # built and checked, nothing launched
    assert isinstance(fabric.strategy, DeepSpeedStrategy)
    assert fabric.strategy.config["zero_optimization"]["stage"] == 1
    assert fabric.strategy.config["gradient_clipping"] == 0.5
    assert config == {"zero_optimization": {"stage": 1}, "gradient_clipping": 0.5}  # the caller's dict is untouched
    assert isinstance(Fabric(**translate_fabric_choices({"accelerator": "cpu"}, None, {})).strategy, DeepSpeedStrategy)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
@pytest.mark.parametrize(("section", "precision"), [("fp16", "16-mixed"), ("bf16", "bf16-mixed"), (None, "32-true")])
def test_a_deepspeed_config_sets_the_precision_when_none_is_given(section: str | None, precision: str) -> None:
    """Seed 003's form: ``deepspeed_config={"train_batch_size": 2048, "fp16": {"enabled": True}}`` and no
    precision. It was refused because the default precision, 32-true, contradicted the config."""
    config: dict[str, Any] = {"train_batch_size": 2048}
    if section is not None:
        config[section] = {"enabled": True}
    fabric = Fabric(**translate_fabric_choices({"accelerator": "cpu", "devices": 2}, None, config))
    assert fabric.precision.name == precision
    assert fabric.strategy.config.get(section or "fp16", {}).get("enabled", False) is (section is not None)
    given = translate_fabric_choices({"accelerator": "cpu", "devices": 2, "precision": "32-true"}, None, config)
    if section is not None:  # a precision given and contradicting the config is still an error naming both
        with pytest.raises(ValueError, match=f"config enables {section}.*Fabric's precision is '32-true'"):
            Fabric(**given)


def test_deepspeed_config_with_another_strategy_fails_naming_both() -> None:
    with pytest.raises(ValueError, match=r"deepspeed_config= selects the DeepSpeed strategy, but strategy='ddp'"):
        _trainer(deepspeed_config={}, strategy="ddp")


# --- load_path_format -------------------------------------------------------------------------------


def test_load_path_format_loads_like_load_path(tmp_path: Path) -> None:
    first = _trainer(max_duration="3ba")
    first.fit()
    path = str(tmp_path / "checkpoint.pt")
    first.save_checkpoint(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed = _trainer(load_path_format=path)
    assert int(resumed.state.timestamp.batch) == 3
    assert torch.equal(resumed.state.model.module.linear.weight, first.state.model.module.linear.weight)
    with pytest.raises(ValueError, match=r"load_path='a\.pt' and load_path_format='b\.pt' disagree"):
        _trainer(load_path="a.pt", load_path_format="b.pt")


# --- grad_accum -------------------------------------------------------------------------------------


def test_grad_accum_splits_each_batch_into_that_many_microbatches_with_the_same_gradient() -> None:
    sizes = ForwardSizes()
    accumulated = _trainer(grad_accum=4, callbacks=[sizes], max_duration="2ba")
    assert accumulated.state.device_train_microbatch_size == 2  # batch 8 / 4
    accumulated.fit()
    assert sizes.sizes == [2] * 8  # 4 microbatches of 2 in each of the 2 batches
    whole = _trainer(max_duration="2ba")
    whole.fit()
    torch.testing.assert_close(
        accumulated.state.model.module.linear.weight, whole.state.model.module.linear.weight, rtol=1e-6, atol=1e-7
    )
    assert _trainer(grad_accum=1).state.device_train_microbatch_size is None
    assert _trainer(grad_accum="auto").state.device_train_microbatch_size is None  # auto starts with the batch


def test_grad_accum_that_does_not_divide_the_batch_fails_naming_both_numbers() -> None:
    with pytest.raises(ValueError, match=r"grad_accum=3 does not divide the train dataloader's batch_size=8"):
        _trainer(grad_accum=3)
    trainer = _trainer(grad_accum=4, max_duration="1ba")
    with pytest.raises(ValueError, match=r"grad_accum=4 does not divide the train dataloader's batch_size=6"):
        trainer.fit(train_dataloader=_loader(batch_size=6))  # a loader given to fit() is checked there


def test_grad_accum_with_a_microbatch_size_or_a_bad_value_fails() -> None:
    with pytest.raises(ValueError, match=r"grad_accum=2 and device_train_microbatch_size=4 both set"):
        _trainer(grad_accum=2, device_train_microbatch_size=4)
    with pytest.raises(ValueError, match=r"grad_accum=0 must be a positive int"):
        _trainer(grad_accum=0)
    batches = [(torch.randn(8, 4), torch.randn(8))]
    with pytest.raises(ValueError, match=r"needs the train dataloader's batch_size; this list has none"):
        _trainer(grad_accum=2, train_dataloader=batches)
