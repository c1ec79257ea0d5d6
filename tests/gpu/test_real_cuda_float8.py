"""``precision="fp8-mixed"`` on a real CUDA GPU: where the GPU has float8 tensor cores (compute capability 8.9+), a
small language model trains in float8 eager and compiled, following bf16-mixed and measurably not bf16; on an older
GPU, ``Fabric(...)`` refuses in one line naming its capability. Skipped without a CUDA GPU (``tests/conftest.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from float8_model import BODY_LAYERS, TinyLM

from fabric import Fabric
from fabric.plugins.precision.float8 import MIN_CUDA_CAPABILITY

pytestmark = pytest.mark.cuda

VOCAB, WIDTH, STEPS = 512, 256, 30
HAS_GPU = torch.cuda.is_available()  # without one, tests/conftest.py skips both tests, saying so
HAS_FLOAT8 = HAS_GPU and torch.cuda.get_device_capability() >= MIN_CUDA_CAPABILITY


def _train(precision: str, compile: bool = False) -> tuple[torch.Tensor, list[str]]:
    torch.manual_seed(0)
    module = TinyLM(VOCAB, WIDTH)
    fabric = Fabric(accelerator="cuda", devices=1, precision=precision)
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-3), compile=compile)
    tokens = torch.randint(0, VOCAB, (16, 129), generator=torch.Generator().manual_seed(1)).cuda()
    losses = []
    for _ in range(STEPS):
        loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    converted = [name for name, layer in module.named_modules() if type(layer).__name__ == "Float8Linear"]
    return torch.tensor(losses), converted


@pytest.mark.skipif(HAS_GPU and not HAS_FLOAT8, reason="no float8 tensor cores: the refusal test covers it")
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_fp8_mixed_trains_on_the_gpu_following_bf16_mixed(compile: bool) -> None:
    bf16, _ = _train("bf16-mixed", compile)
    fp8, converted = _train("fp8-mixed", compile)
    fp32, _ = _train("32-true", compile)
    assert converted == BODY_LAYERS
    assert fp8[-1] < 0.8 * fp8[0]
    fp8_gap = ((fp8 - bf16).abs() / bf16).max().item()
    bf16_gap = ((bf16 - fp32).abs() / fp32).max().item()
    assert fp8_gap < 0.02, f"fp8-mixed left bf16-mixed by {fp8_gap:.2%} of the loss within {STEPS} steps"
    assert fp8_gap > 2 * bf16_gap, (fp8_gap, bf16_gap)  # float8 rounding really happened


@pytest.mark.skipif(HAS_FLOAT8, reason="this GPU has float8 tensor cores: the training test covers it")
def test_a_gpu_without_float8_tensor_cores_is_refused_naming_its_capability() -> None:
    major, minor = torch.cuda.get_device_capability()
    with pytest.raises(ValueError, match=rf"has {major}\.{minor}\. Use 'bf16-mixed'"):
        Fabric(accelerator="cuda", devices=1, precision="fp8-mixed")
