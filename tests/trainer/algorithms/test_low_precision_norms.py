"""LowPrecisionLayerNorm / LowPrecisionGroupNorm: exactly the original norms in float32, the autocast dtype under
autocast, applied only with a mixed precision, and a model that still learns with them under bf16 autocast."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric.trainer.algorithms import LowPrecisionGroupNorm, LowPrecisionLayerNorm
from fabric.trainer.algorithms.low_precision_groupnorm import LPGroupNorm, apply_low_precision_groupnorm
from fabric.trainer.algorithms.low_precision_layernorm import LPLayerNorm, apply_low_precision_layernorm


def _layernorm() -> nn.LayerNorm:
    torch.manual_seed(0)
    norm = nn.LayerNorm(12)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.normal_()
    return norm


def _groupnorm() -> nn.GroupNorm:
    torch.manual_seed(0)
    norm = nn.GroupNorm(3, 12)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.normal_()
    return norm


def test_in_float32_the_low_precision_layernorm_is_exactly_layernorm() -> None:
    original = _layernorm()
    low = LPLayerNorm.from_layernorm(original)
    x = torch.randn(4, 5, 12) * 3 + 1
    assert torch.equal(low(x), original(x))
    assert low.weight is original.weight and low.bias is original.bias
    assert list(low.state_dict()) == list(original.state_dict())


def test_in_float32_the_low_precision_groupnorm_is_exactly_groupnorm() -> None:
    original = _groupnorm()
    low = LPGroupNorm.from_groupnorm(original)
    x = torch.randn(4, 12, 3, 3) * 3 + 1
    assert torch.equal(low(x), original(x))
    assert low.weight is original.weight and low.bias is original.bias


def test_under_autocast_layernorm_runs_in_the_autocast_dtype_without_upcasting() -> None:
    original = _layernorm()
    low = LPLayerNorm.from_layernorm(original)
    x = torch.randn(4, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept, lowered = original(x), low(x)
    assert kept.dtype == torch.float32  # autocast runs nn.LayerNorm in float32 (CUDA: always; CPU: float32 inputs)
    assert lowered.dtype == torch.bfloat16
    expected = F.layer_norm(x.bfloat16(), (12,), original.weight.bfloat16(), original.bias.bfloat16(), original.eps)
    assert torch.equal(lowered, expected)
    torch.testing.assert_close(lowered.float(), original(x), atol=0.05, rtol=0.02)


def test_under_autocast_groupnorm_runs_in_the_autocast_dtype_without_upcasting() -> None:
    original = _groupnorm()
    low = LPGroupNorm.from_groupnorm(original)
    x = torch.randn(2, 12, 4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept, lowered = original(x), low(x)
    assert kept.dtype == torch.float32
    assert lowered.dtype == torch.bfloat16
    expected = F.group_norm(x.bfloat16(), 3, original.weight.bfloat16(), original.bias.bfloat16(), original.eps)
    assert torch.equal(lowered, expected)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "amp_bf16", "amp_fp16", "amp"])
def test_the_functions_replace_the_norms_with_a_mixed_precision(precision: str) -> None:
    model = nn.Sequential(nn.Linear(4, 12), nn.LayerNorm(12), nn.Unflatten(1, (12, 1, 1)), nn.GroupNorm(3, 12))
    reference = copy.deepcopy(model)
    assert list(apply_low_precision_layernorm(model, precision)) == ["1"]
    assert list(apply_low_precision_groupnorm(model, precision)) == ["3"]
    assert type(model[1]) is LPLayerNorm and type(model[3]) is LPGroupNorm
    x = torch.randn(3, 4)
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("precision", ["32-true", "fp32", "bf16-true", "64"])
def test_without_a_mixed_precision_they_warn_and_change_nothing(precision: str) -> None:
    model = nn.Sequential(nn.LayerNorm(4), nn.GroupNorm(2, 4))
    with pytest.warns(UserWarning, match="only applies with a mixed precision"):
        assert apply_low_precision_layernorm(model, precision) == {}
    with pytest.warns(UserWarning, match="only applies with a mixed precision"):
        assert apply_low_precision_groupnorm(model, precision) == {}
    assert type(model[0]) is nn.LayerNorm and type(model[1]) is nn.GroupNorm


class NormNet(nn.Module):
    """Linear -> LayerNorm -> conv view -> GroupNorm -> head, over ``(inputs, targets)`` batches."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.layernorm = nn.Linear(8, 16), nn.LayerNorm(16)
        self.groupnorm, self.head = nn.GroupNorm(4, 16), nn.Linear(16, 3)

    def forward(self, batch: Any) -> torch.Tensor:
        hidden = torch.relu(self.layernorm(self.inp(batch[0])))
        hidden = torch.relu(self.groupnorm(hidden.view(-1, 16, 1, 1))).flatten(1)
        output: torch.Tensor = self.head(hidden)
        return output

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.cross_entropy(outputs.float(), batch[1])


def _fit(algorithms: list[Any], precision: str) -> tuple[NormNet, float, float]:
    from fabric.trainer.trainer import Trainer

    torch.manual_seed(0)
    inputs = torch.randn(256, 8)
    targets = (inputs[:, :3] * torch.tensor([1.0, -1.0, 0.5])).argmax(1)
    model = NormNet()
    with torch.no_grad():
        before = model.loss(model((inputs, targets)), (inputs, targets)).item()
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(TensorDataset(inputs, targets), batch_size=32),
        max_duration="6ep",
        optimizers=torch.optim.Adam(model.parameters(), lr=0.02),
        algorithms=algorithms,
        precision=precision,
        progress_bar=False,
        seed=0,
        accelerator="cpu",
    )
    trainer.fit()
    trainer.close()
    with torch.no_grad():
        after = model.loss(model((inputs, targets)), (inputs, targets)).item()
    return model, before, after


def test_a_model_learns_with_both_under_bf16_autocast() -> None:
    model, before, after = _fit([LowPrecisionLayerNorm(), LowPrecisionGroupNorm()], "bf16-mixed")
    assert type(model.layernorm) is LPLayerNorm and type(model.groupnorm) is LPGroupNorm
    assert after < 0.5 * before, (before, after)


def test_in_a_float32_run_the_algorithms_warn_and_leave_the_model_alone() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _, _ = _fit([LowPrecisionLayerNorm(), LowPrecisionGroupNorm()], "32-true")
    messages = [str(warning.message) for warning in caught]
    assert any("LowPrecisionLayerNorm only applies with a mixed precision" in m for m in messages)
    assert any("LowPrecisionGroupNorm only applies with a mixed precision" in m for m in messages)
    assert type(model.layernorm) is nn.LayerNorm and type(model.groupnorm) is nn.GroupNorm
