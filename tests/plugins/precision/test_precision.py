"""Each precision really trains on CPU in the dtypes it promises."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from fabric import Fabric
from fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from fabric.strategies import SingleDeviceStrategy

ALL_PRECISIONS = ["32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"]


class Recorder(nn.Module):
    """A small classifier that records the dtype its hidden layer computed in."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(8, 32)
        self.out = nn.Linear(32, 2)
        self.compute_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.hidden(x)
        self.compute_dtype = hidden.dtype
        return self.out(torch.relu(hidden))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=generator)
    return x, (x[:, 0] + x[:, 1] > 0).long()


def _train(precision: str, steps: int = 60) -> tuple[Fabric, Recorder, list[float], torch.Tensor]:
    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", precision=precision)
    model = Recorder()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    fabric_model, optimizer = fabric.setup(model, optimizer)
    x, y = _data()
    losses = []
    output = torch.empty(0)
    for _ in range(steps):
        output = fabric_model(x)
        loss = F.cross_entropy(output, y)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    return fabric, model, losses, output


EXPECTED = {
    # precision: (parameter dtype, dtype the matmul ran in, output dtype the user gets)
    "32-true": (torch.float32, torch.float32, torch.float32),
    "64-true": (torch.float64, torch.float64, torch.float64),
    "16-mixed": (torch.float32, torch.float16, torch.float32),
    "bf16-mixed": (torch.float32, torch.bfloat16, torch.float32),
    "16-true": (torch.float16, torch.float16, torch.float32),
    "bf16-true": (torch.bfloat16, torch.bfloat16, torch.float32),
}


@pytest.mark.parametrize("precision", ALL_PRECISIONS)
def test_each_precision_trains_in_the_promised_dtypes(precision: str) -> None:
    _fabric, model, losses, output = _train(precision)
    parameter_dtype, compute_dtype, output_dtype = EXPECTED[precision]
    assert all(p.dtype == parameter_dtype for p in model.parameters())
    assert model.compute_dtype == compute_dtype
    assert output.dtype == output_dtype
    assert losses[-1] < 0.6 * losses[0], f"{precision}: loss did not fall ({losses[0]:.3f} -> {losses[-1]:.3f})"


def test_mixed_precision_results_differ_from_float32_but_stay_close() -> None:
    """bf16 autocast really changes the arithmetic (it is not silently float32)."""
    _, _, losses32, _ = _train("32-true", steps=5)
    _, _, losses_bf16, _ = _train("bf16-mixed", steps=5)
    assert losses32 != losses_bf16
    assert abs(losses32[-1] - losses_bf16[-1]) < 0.05


def test_16_mixed_on_cpu_is_float16_autocast_with_a_grad_scaler() -> None:
    fabric, _, _, _ = _train("16-mixed", steps=3)
    precision = fabric.precision
    assert isinstance(precision, MixedPrecision)
    assert precision.dtype == torch.float16
    assert precision.scaler is not None and precision.scaler.is_enabled()
    assert precision.scaler.get_scale() > 1.0


def test_bf16_mixed_uses_no_scaler() -> None:
    precision = Fabric(accelerator="cpu", precision="bf16-mixed").precision
    assert isinstance(precision, MixedPrecision)
    assert precision.scaler is None


@pytest.mark.parametrize("default", [torch.float32, torch.float64])
def test_mixed_precision_casts_half_outputs_back_to_the_default_dtype_only(default: torch.dtype) -> None:
    precision = MixedPrecision("bf16-mixed")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        half, single, tokens = torch.ones(2, dtype=torch.bfloat16), torch.ones(2), torch.ones(2, dtype=torch.long)
        assert precision.convert_output(half).dtype == default  # a lone tensor: the fast path
        assert precision.convert_output(single) is single and precision.convert_output(tokens) is tokens
        nested = precision.convert_output({"logits": half, "ids": tokens, "aux": [torch.ones(1, dtype=torch.float16)]})
        assert (nested["logits"].dtype, nested["ids"].dtype, nested["aux"][0].dtype) == (default, torch.long, default)
    finally:
        torch.set_default_dtype(previous)


def test_grad_scaler_skips_steps_with_non_finite_gradients() -> None:
    fabric = Fabric(accelerator="cpu", precision="16-mixed")
    layer = nn.Linear(4, 1)
    model, optimizer = fabric.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    before = [p.detach().clone() for p in layer.parameters()]
    scale_before = fabric.precision.scaler.get_scale()  # type: ignore[attr-defined]
    loss = model(torch.full((2, 4), float("inf"))).sum()
    fabric.backward(loss)
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters(), strict=False))
    assert fabric.precision.scaler.get_scale() < scale_before  # type: ignore[attr-defined]


def test_loss_backward_instead_of_fabric_backward_is_caught_when_it_matters() -> None:
    fabric = Fabric(accelerator="cpu", precision="16-mixed")
    model = fabric.setup(nn.Linear(4, 1))
    with pytest.raises(RuntimeError, match=r"fabric.backward\(loss\)"):
        model(torch.randn(2, 4)).sum().backward()


def test_true_half_precision_casts_floating_inputs_only() -> None:
    precision = HalfPrecision("bf16-true")
    floats, ints = precision.convert_input((torch.randn(2), torch.arange(3)))
    assert floats.dtype == torch.bfloat16
    assert ints.dtype == torch.int64


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("32-true", torch.float32), ("64-true", torch.float64), ("bf16-true", torch.bfloat16), ("16-true", torch.float16)],
)
def test_init_module_and_init_tensor_create_in_the_precision_dtype(precision: str, dtype: torch.dtype) -> None:
    fabric = Fabric(accelerator="cpu", precision=precision)
    with fabric.init_module():
        layer = nn.Linear(3, 3)
    with fabric.init_tensor():
        tensor = torch.empty(2)
    assert layer.weight.dtype == dtype
    assert tensor.dtype == dtype
    assert torch.get_default_dtype() == torch.float32  # restored afterwards


def test_mixed_precision_keeps_float32_parameters_at_init() -> None:
    fabric = Fabric(accelerator="cpu", precision="bf16-mixed")
    with fabric.init_module():
        layer = nn.Linear(3, 3)
    assert layer.weight.dtype == torch.float32


def test_autocast_context_applies_outside_the_module() -> None:
    fabric = Fabric(accelerator="cpu", precision="bf16-mixed")
    with fabric.autocast():
        product = torch.randn(4, 4) @ torch.randn(4, 4)
    assert product.dtype == torch.bfloat16


def test_gradient_clipping_unscales_first_under_16_mixed() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    fabric = Fabric(accelerator="cpu", plugins=MixedPrecision("16-mixed", scaler=scaler))
    layer = nn.Linear(4, 1)
    model, optimizer = fabric.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    fabric.backward(model(torch.ones(8, 4) * 0.5).mean())
    norm = fabric.clip_gradients(model, optimizer, max_norm=0.1)
    assert norm is not None
    # The reported norm is the true one (sqrt(4 * 0.25 + 1) for these inputs), not multiplied by the scale.
    assert norm.item() == pytest.approx(2**0.5, rel=1e-3)
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in layer.parameters()]))
    assert clipped.item() == pytest.approx(0.1, rel=1e-3)
    optimizer.step()


def test_clipping_an_overflowing_16_mixed_step_lets_the_scaler_skip_it() -> None:
    fabric = Fabric(accelerator="cpu", precision="16-mixed")
    layer = nn.Linear(4, 1)
    model, optimizer = fabric.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    before = [p.detach().clone() for p in layer.parameters()]
    fabric.backward(model(torch.full((2, 4), 1e4)).sum())  # overflows float16 once scaled
    norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
    assert norm is not None and not torch.isfinite(norm)
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters(), strict=False))


def test_clipping_non_finite_gradients_without_a_scaler_raises() -> None:
    fabric = Fabric(accelerator="cpu")
    layer = nn.Linear(4, 1)
    model, optimizer = fabric.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    fabric.backward(model(torch.full((2, 4), float("inf"))).sum())
    with pytest.raises(RuntimeError, match="non-finite"):
        fabric.clip_gradients(model, optimizer, max_norm=1.0)


class _ScaledBackward(Precision):
    """A plugin that changes only the backward (as a loss scaler does): the loss is doubled before it."""

    @override
    def pre_backward(self, tensor: torch.Tensor, module: nn.Module | None) -> torch.Tensor:
        return tensor * 2


class _CountedZeroGrad(SingleDeviceStrategy):
    """A strategy that changes only how gradients are cleared: it counts the calls."""

    cleared = 0

    @override
    def optimizer_zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        type(self).cleared += 1
        super().optimizer_zero_grad(optimizer, set_to_none)


class _CountedBackward(SingleDeviceStrategy):
    """A strategy that changes only the backward: it counts the calls."""

    backwards = 0

    @override
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        type(self).backwards += 1
        super().backward(tensor, module, *args, **kwargs)


class _GuardedBackward(Precision):
    """A plugin that only asks for ``fabric.backward`` (and runs the forward through the wrapper, which guards
    its outputs): the strategy must then mark the backward as Fabric's."""

    forward_is_identity = False
    requires_fabric_backward = True


def test_fabric_backward_goes_through_a_strategy_or_precision_that_changed_it() -> None:
    assert SingleDeviceStrategy.backward_is_plain and not _CountedBackward.backward_is_plain
    assert not _GuardedBackward.backward_is_plain
    fabric = Fabric(accelerator="cpu", strategy=_CountedBackward())
    model = fabric.setup(nn.Linear(2, 1))
    fabric.backward(model(torch.ones(1, 2)).sum())
    assert _CountedBackward.backwards == 1
    guarded = Fabric(accelerator="cpu", strategy=SingleDeviceStrategy(precision=_GuardedBackward()))
    model = guarded.setup(nn.Linear(2, 1))
    loss = model(torch.ones(1, 2)).sum()
    with pytest.raises(RuntimeError, match=r"Call `fabric\.backward"):
        loss.backward(retain_graph=True)
    guarded.backward(loss)  # the guard lets Fabric's own backward through
    assert model.module.weight.grad is not None


def test_the_plain_hooks_are_skipped_only_where_a_subclass_did_not_change_them() -> None:
    """Fabric skips the base class's no-op backward and step hooks on the per-step path; a subclass that overrides
    one of them is called, on a different hook than the others it left alone."""
    assert Precision.backward_is_plain and Precision.optimizer_step_is_plain
    assert not _ScaledBackward.backward_is_plain and _ScaledBackward.optimizer_step_is_plain
    assert not MixedPrecision.backward_is_plain and not MixedPrecision.optimizer_step_is_plain
    # an instance whose overrides are no-ops says so: bf16-mixed has no scaler, 16-mixed scales and steps through one
    bf16, fp16 = MixedPrecision("bf16-mixed"), MixedPrecision("16-mixed")
    assert bf16.backward_is_plain and bf16.optimizer_step_is_plain
    assert not fp16.backward_is_plain and not fp16.optimizer_step_is_plain
    assert SingleDeviceStrategy.optimizer_step_is_plain and SingleDeviceStrategy.optimizer_zero_grad_is_plain
    assert _CountedZeroGrad.optimizer_step_is_plain and not _CountedZeroGrad.optimizer_zero_grad_is_plain

    fabric = Fabric(accelerator="cpu", strategy=_CountedZeroGrad(precision=_ScaledBackward()))
    module = nn.Linear(2, 1, bias=False)
    nn.init.ones_(module.weight)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=1.0))
    fabric.backward(model(torch.ones(1, 2)).sum())
    assert torch.equal(module.weight.grad, torch.full((1, 2), 2.0))  # through the overridden pre_backward
    optimizer.step()  # the plain step: the optimizer itself
    assert torch.equal(module.weight.detach(), torch.full((1, 2), -1.0))
    optimizer.zero_grad()
    assert _CountedZeroGrad.cleared == 1 and module.weight.grad is None
