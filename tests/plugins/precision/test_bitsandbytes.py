"""BitsandbytesPrecision on CPU (bitsandbytes >= 0.50 runs there; Lightning refuses CPUs): the Linear layers'
weights are really quantized, compute matches the dequantized weights, a full-precision checkpoint loads into a model
built quantized, adapters train beside frozen quantized weights (QLoRA), and what cannot work is refused in one line."""

from __future__ import annotations

from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.plugins.precision.bitsandbytes import MODES, BitsandbytesPrecision
from fabric.utilities.exceptions import CheckpointError

COMPUTE_DTYPES = {"nf4": torch.bfloat16, "nf4-dq": torch.bfloat16, "fp4": torch.float16, "fp4-dq": torch.bfloat16,
                  "int8": torch.float16}  # fmt: skip


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _dequantized(layer: nn.Module) -> torch.Tensor:
    """The weight the quantized layer computes with, as bitsandbytes itself dequantizes it."""
    weight = layer.weight
    if weight.dtype == torch.uint8:
        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state).float()
    scales = weight.SCB if weight.SCB is not None else layer.state.SCB  # moved to the layer's state at a forward
    return weight.data.float() * scales.float()[:, None] / 127


@pytest.mark.parametrize("mode", MODES)
def test_linear_weights_are_quantized_and_compute_with_their_dequantized_values(mode: str) -> None:
    torch.manual_seed(0)
    model = Net().requires_grad_(False)
    full = {name: value.clone() for name, value in model.state_dict().items()}
    fabric = Fabric(accelerator="cpu", plugins=BitsandbytesPrecision(mode, COMPUTE_DTYPES[mode], {"head"}))
    quantized = fabric.setup(model)
    layers = [quantized.module.body[0], quantized.module.body[2]]
    four_bit = not mode.startswith("int8")
    for layer in layers:
        assert layer.weight.dtype == (torch.uint8 if four_bit else torch.int8) and not layer.weight.requires_grad
        bits = layer.weight.numel() * layer.weight.element_size() * 8
        assert bits == layer.in_features * layer.out_features * (4 if four_bit else 8)
    assert type(quantized.module.head) is nn.Linear  # ignore_modules: kept, in the compute dtype
    assert quantized.module.head.weight.dtype == COMPUTE_DTYPES[mode]
    x = torch.randn(16, 64)
    with torch.no_grad():
        output = quantized(x)
        hidden = torch.relu(x @ _dequantized(layers[0]).T + full["body.0.bias"])
        hidden = hidden @ _dequantized(layers[1]).T + full["body.2.bias"]
        head = {name: full[f"head.{name}"].to(COMPUTE_DTYPES[mode]).float() for name in ("weight", "bias")}
        expected = hidden @ head["weight"].T + head["bias"]
        exact = Net()
        exact.load_state_dict(full)
        unquantized = exact(x)
    assert output.dtype == torch.float32
    scale = expected.abs().mean()
    assert (output - expected).abs().mean() / scale < (0.02 if four_bit else 0.05)  # compute dtype and int8 inputs
    error = (output - unquantized).abs().mean() / unquantized.abs().mean()
    assert 0.001 < error < 0.25  # quantized: not the float32 result, but close to it


def test_a_model_built_quantized_loads_a_full_precision_checkpoint_as_a_converted_one_computes(tmp_path: Path) -> None:
    """litgpt's ``generate --quantize``: built under ``init_module(empty_init=True)``, then the full-precision
    ``lit_model.pth`` loads, each weight quantized as it arrives."""
    torch.manual_seed(0)
    original = Net()
    torch.save(original.state_dict(), tmp_path / "weights.pth")
    fabric = Fabric(accelerator="cpu", plugins=BitsandbytesPrecision("nf4-dq", torch.bfloat16))
    converted = fabric.setup(Net())
    fabric.load_raw(tmp_path / "weights.pth", converted)
    with fabric.init_module(empty_init=True):
        built = Net()
    assert built.head.weight.dtype == torch.uint8  # quantized from the start
    built = fabric.setup(built)
    fabric.load_raw(tmp_path / "weights.pth", built)
    x = torch.randn(8, 64)
    assert torch.equal(built(x), converted(x))
    torch.save({"model": Net().state_dict() | {"head.weight": torch.zeros(8, 31)}}, tmp_path / "wrong.pth")
    before = built(x)
    with pytest.raises(CheckpointError, match=r"'head\.weight' has shape \(8, 31\), the model has \(8, 32\)"):
        fabric.load(tmp_path / "wrong.pth", {"model": built})
    assert torch.equal(built(x), before)  # nothing was loaded


def test_adapters_train_beside_frozen_quantized_weights() -> None:
    """QLoRA's shape: a frozen 4-bit base, a trainable low-rank update; the base's weights never change."""
    torch.manual_seed(0)

    class Adapted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = nn.Linear(32, 32)
            self.down, self.up = nn.Linear(32, 4, bias=False), nn.Linear(4, 32, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + self.up(self.down(x))

    fabric = Fabric(accelerator="cpu", plugins=BitsandbytesPrecision("nf4", torch.bfloat16, {"down", "up"}))
    model = Adapted()
    model.base.requires_grad_(False)
    optimizer = torch.optim.Adam([*model.down.parameters(), *model.up.parameters()], lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    packed = model.module.base.weight.data.clone()
    x, target = torch.randn(64, 32), torch.randn(64, 32)
    losses = []
    for _ in range(30):
        loss = nn.functional.mse_loss(model(x), target)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.95 * losses[0]
    assert torch.equal(model.module.base.weight.data, packed)


def test_weights_that_required_grad_are_frozen_with_a_warning_and_their_biases_still_train() -> None:
    """An optimizer made before ``setup`` holds the layers' biases: they are the same objects after quantization, so
    they train; the quantized weights cannot, and the warning says so instead of leaving them silently still."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fabric = Fabric(accelerator="cpu", plugins=BitsandbytesPrecision("nf4", torch.bfloat16))
    with pytest.warns(UserWarning, match=r"froze the weights of 3 Linear layer\(s\) that required grad \(body\.0, "):
        model, optimizer = fabric.setup(model, optimizer)
    bias = model.module.head.bias.detach().clone()
    fabric.backward(model(torch.randn(4, 64)).sum())
    optimizer.step()
    assert not torch.equal(model.module.head.bias, bias)


def test_what_cannot_work_is_refused_in_one_line_naming_the_value() -> None:
    with pytest.raises(ValueError, match=r"mode='int8-training'\), int8 weights that train, is not provided"):
        BitsandbytesPrecision("int8-training")
    with pytest.raises(ValueError, match=r"mode='nf8'\) is not a mode; accepted: \['nf4', 'nf4-dq'"):
        BitsandbytesPrecision("nf8")
    with pytest.raises(ValueError, match=r"mode='int8'\) computes in float16 only, not dtype=torch\.bfloat16"):
        BitsandbytesPrecision("int8", torch.bfloat16)
    fabric = Fabric(accelerator="cpu", plugins=BitsandbytesPrecision("nf4", torch.bfloat16))
    with pytest.raises(TypeError, match="Conv1d has none: nothing would be quantized"):
        fabric.setup(nn.Conv1d(2, 2, 1))
    ignoring = Fabric(accelerator="cpu", plugins=BitsandbytesPrecision("nf4", torch.bfloat16, {"head"}))
    with pytest.raises(ValueError, match=r"cannot build the model under fabric\.init_module"), ignoring.init_module():
        pass
    with pytest.raises(ValueError, match=r"BitsandbytesPrecision replaces whole layers .* FSDPStrategy shards"):
        Fabric(accelerator="cpu", devices=2, strategy="fsdp", plugins=BitsandbytesPrecision("nf4", torch.bfloat16))


@pytest.mark.parametrize("mode", [mode for mode in MODES if not mode.startswith("int8")])
def test_a_4bit_layer_narrower_than_a_quantization_block_computes_in_eval_mode(mode: str) -> None:
    """On a CPU with AVX512-BF16, bitsandbytes repacks 4-bit weights for a faster kernel at an eval forward without
    gradients, which needs the input width to be a multiple of 64: a layer of 32 inputs failed there (litgpt's
    ``generate`` on a small model). It keeps the general kernel and computes with its dequantized weight."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 96)).requires_grad_(False)
    bias = model[0].bias.clone()
    fabric = Fabric(accelerator="cpu", plugins=BitsandbytesPrecision(mode, COMPUTE_DTYPES[mode]))
    quantized = fabric.setup(model).eval()
    layer = quantized.module[0]
    x = torch.randn(4, 32)
    with torch.no_grad():
        expected = x @ _dequantized(layer).T + bias
        output = quantized(x)
    assert (output.float() - expected).abs().mean() / expected.abs().mean() < 0.02


@pytest.mark.parametrize("mode", [mode for mode in MODES if not mode.startswith("int8")])
def test_a_4bit_layer_trains_after_an_eval_forward(mode: str) -> None:
    """bitsandbytes repacked 4-bit weights for good for its AVX512-BF16 CPU kernel at an eval forward, and the next
    training forward failed at the layer's trainable bias (litgpt's fine-tune validates on the way)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64))
    model[0].weight.requires_grad_(False)
    fabric = Fabric(accelerator="cpu", plugins=BitsandbytesPrecision(mode, COMPUTE_DTYPES[mode]))
    quantized = fabric.setup(model)
    x = torch.randn(4, 64)
    quantized.eval()
    with torch.no_grad():
        before = quantized(x)
    quantized.train()
    loss = quantized(x).float().pow(2).mean()
    loss.backward()
    assert quantized.module[0].bias.grad is not None and torch.isfinite(before).all()
