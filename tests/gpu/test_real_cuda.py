"""Fabric on a real CUDA GPU: device choice, every precision, FSDP2 on one GPU, meta-device init then load,
``setup(compile=True)``, a GPU checkpoint read by a CPU-only process, and FLOPs/MFU against the device's peak.

Each test trains or runs the model on ``cuda`` and compares numbers with a plain PyTorch reference. Where there
is no CUDA GPU they are skipped (``tests/conftest.py``); ``scripts/gpu_check.sh`` runs them on a GPU machine.
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gpu_tools import (
    LR,
    ROOT,
    full_parameters,
    make_mlp,
    max_difference,
    mse,
    regression_data,
    train,
)
from torch import nn
from torch.distributed.tensor import DTensor

from fabric import Fabric
from fabric.accelerators import CUDAAccelerator
from fabric.plugins.precision import MixedPrecision
from fabric.strategies.fsdp import FSDPStrategy
from fabric.utilities.throughput import ThroughputMonitor, device_peak_flops, measure_flops

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda", 0)


def _reference(init: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[list[torch.Tensor], list[float]]:
    """Plain float32 PyTorch on the GPU: the weights after training a copy of ``init``, and the losses."""
    model = copy.deepcopy(init).to(CUDA)
    losses = train(model, torch.optim.SGD(model.parameters(), lr=LR), x, y)
    return full_parameters(model), losses


@pytest.fixture
def fsdp_fabric(request: pytest.FixtureRequest) -> Iterator[Fabric]:
    """A one-GPU FSDP Fabric (``request.param``: the strategy name), its process group destroyed afterwards."""
    fabric = Fabric(accelerator="cuda", devices=1, strategy=request.param)
    try:
        fabric.launch()  # one process: nothing to start, the group of one is joined already
        yield fabric
    finally:
        fabric.strategy.teardown()


# --- the device ----------------------------------------------------------------------------------------------


def test_auto_accelerator_picks_cuda_and_computes_there() -> None:
    fabric = Fabric()  # all GPUs: with several, a DDP job that is not launched yet; with one, ready
    assert isinstance(fabric.accelerator, CUDAAccelerator)
    assert fabric.device == torch.device("cuda", 0)
    fabric = Fabric(devices=1)
    assert fabric.device == torch.device("cuda", 0)
    model = fabric.setup(nn.Linear(4, 2))
    output = model(fabric.to_device(torch.ones(3, 4)))
    assert output.device.type == "cuda"
    assert next(model.parameters()).device.type == "cuda"


# --- precisions ----------------------------------------------------------------------------------------------

#: precision -> (parameter dtype, output dtype, largest allowed |weight - float32 reference weight| after training).
#: The tolerances are 4x to 10x the differences these precisions give on a CPU (bfloat16 keeps 8 mantissa bits,
#: float16 11), and below a third of how far training moves the weights (checked in the test).
PRECISIONS = {
    "32-true": (torch.float32, torch.float32, 1e-6),
    "64-true": (torch.float64, torch.float64, 1e-5),
    "16-mixed": (torch.float32, torch.float32, 2e-4),
    "bf16-mixed": (torch.float32, torch.float32, 1.5e-3),
    "16-true": (torch.float16, torch.float32, 2e-3),
    "bf16-true": (torch.bfloat16, torch.float32, 2e-2),
}


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_each_precision_trains_like_float32_within_its_dtypes_tolerance(precision: str) -> None:
    parameter_dtype, output_dtype, tolerance = PRECISIONS[precision]
    torch.manual_seed(0)
    init = make_mlp()
    x, y = regression_data(CUDA)
    reference, reference_losses = _reference(init, x, y)

    fabric = Fabric(accelerator="cuda", devices=1, precision=precision)
    model = copy.deepcopy(init)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    assert {parameter.dtype for parameter in model.parameters()} == {parameter_dtype}
    assert {parameter.device.type for parameter in model.parameters()} == {"cuda"}
    assert model(x).dtype == output_dtype
    losses = train(model, optimizer, x, y, backward=fabric.backward)

    moved = max_difference(reference, full_parameters(init))
    assert moved > 3 * tolerance, f"training moved the weights by only {moved}"
    difference = max_difference(full_parameters(model), reference)
    assert difference <= tolerance, f"{precision}: weights differ from float32's by {difference} > {tolerance}"
    assert losses[-1] < 0.9 * losses[0]
    assert losses[-1] == pytest.approx(reference_losses[-1], rel=10 * tolerance, abs=10 * tolerance)


def test_16_mixed_scales_with_a_cuda_grad_scaler_that_skips_a_step_with_non_finite_gradients() -> None:
    fabric = Fabric(accelerator="cuda", devices=1, precision="16-mixed")
    precision = fabric.precision
    assert isinstance(precision, MixedPrecision) and precision.device_type == "cuda"
    scaler = precision.scaler
    assert scaler is not None and scaler.is_enabled() and scaler._device == "cuda"
    torch.manual_seed(0)
    model = make_mlp()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    x, y = regression_data(CUDA)

    train(model, optimizer, x, y, backward=fabric.backward, steps=2)  # finite: both steps are taken
    scale = scaler.get_scale()
    assert scale == 2.0**16  # the initial scale: no step overflowed
    before = full_parameters(model)

    poisoned = x.clone()
    poisoned[0, 0] = float("inf")  # tanh saturates in the forward; the first layer's weight gradient is inf * 0
    loss = mse(model(poisoned), y)
    optimizer.zero_grad()
    fabric.backward(loss)
    assert not all(
        torch.isfinite(parameter.grad).all() for parameter in model.parameters() if parameter.grad is not None
    )
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(full_parameters(model), before, strict=True)), "the step was taken"
    assert scaler.get_scale() == scale * scaler.get_backoff_factor()

    losses = train(model, optimizer, x, y, backward=fabric.backward, steps=1)  # training goes on
    assert math.isfinite(losses[0]) and max_difference(full_parameters(model), before) > 0


# --- FSDP2 on one GPU ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fsdp_fabric", ["fsdp", "fsdp_cpu_offload"], indirect=True)
def test_fsdp_on_one_gpu_trains_like_plain_pytorch(fsdp_fabric: Fabric) -> None:
    fabric = fsdp_fabric
    strategy = fabric.strategy
    assert isinstance(strategy, FSDPStrategy)
    offload = bool(strategy.cpu_offload)
    assert fabric.world_size == 1 and fabric.device.type == "cuda"
    torch.manual_seed(0)
    init = make_mlp()
    x, y = regression_data(CUDA)
    reference, _ = _reference(init, x, y)

    model = copy.deepcopy(init)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    parameters = list(model.parameters())
    assert all(isinstance(parameter, DTensor) for parameter in parameters)
    shard_device = "cpu" if offload else "cuda"
    assert {parameter.to_local().device.type for parameter in parameters} == {shard_device}
    losses = train(model, optimizer, x, y, backward=fabric.backward)

    assert losses[-1] < 0.9 * losses[0]
    difference = max_difference(full_parameters(model), reference)
    assert difference <= 1e-5, f"FSDP ({'CPU offload' if offload else 'on the GPU'}) differs by {difference}"


# --- meta-device init, then load -------------------------------------------------------------------------------


@pytest.fixture
def gpu_checkpoint(tmp_path: Path) -> tuple[Path, list[torch.Tensor]]:
    """A model trained on the GPU, saved by ``fabric.save``; returns the file and the saved weights."""
    fabric = Fabric(accelerator="cuda", devices=1)
    torch.manual_seed(0)
    model = make_mlp()
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    train(model, optimizer, *regression_data(CUDA), backward=fabric.backward, steps=3)
    path = tmp_path / "gpu.pt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})
    return path, full_parameters(model)


def test_empty_init_on_one_gpu_then_load_restores_the_checkpoint_exactly(
    gpu_checkpoint: tuple[Path, list[torch.Tensor]],
) -> None:
    path, saved = gpu_checkpoint
    fabric = Fabric(accelerator="cuda", devices=1)
    with fabric.init_module(empty_init=True):
        empty = make_mlp()
    assert {parameter.device.type for parameter in empty.parameters()} == {"cuda"}  # allocated, not initialised
    model = fabric.setup(empty)
    x, _ = regression_data(CUDA)
    with pytest.raises(RuntimeError, match=r"empty_init=True"):
        model(x)  # refused until a load fills the weights
    fabric.load(path, {"model": model})
    assert all(torch.equal(a, b) for a, b in zip(full_parameters(model), saved, strict=True))
    expected = make_mlp().to(CUDA)
    expected.load_state_dict(dict(zip(expected.state_dict(), saved, strict=True)))
    assert torch.equal(model(x), expected(x))


@pytest.mark.parametrize("fsdp_fabric", ["fsdp"], indirect=True)
def test_fsdp_meta_device_init_then_load_restores_the_checkpoint_exactly(
    gpu_checkpoint: tuple[Path, list[torch.Tensor]], fsdp_fabric: Fabric
) -> None:
    path, saved = gpu_checkpoint
    with fsdp_fabric.init_module(empty_init=True):
        empty = make_mlp()
    assert all(parameter.is_meta for parameter in empty.parameters())  # no memory yet
    model = fsdp_fabric.setup(empty)  # materialised on the GPU, then reset_parameters()
    assert not any(parameter.is_meta for parameter in model.parameters())
    fsdp_fabric.load(path, {"model": model})
    assert all(torch.equal(a, b) for a, b in zip(full_parameters(model), saved, strict=True))


# --- Hugging Face folders -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fsdp_fabric", ["fsdp"], indirect=True)
def test_a_hugging_face_folder_from_gpu_weights_loads_on_the_gpu_and_in_a_cpu_process(
    gpu_checkpoint: tuple[Path, list[torch.Tensor]], fsdp_fabric: Fabric, tmp_path: Path
) -> None:
    """``format="huggingface"`` from CUDA tensors (one device, and FSDP2's DTensors on the GPU), read back into a
    GPU model and by a CPU-only process."""
    pytest.importorskip("safetensors", reason="DCP's Hugging Face writer needs safetensors")
    path, saved = gpu_checkpoint
    fabric = Fabric(accelerator="cuda", devices=1)
    model = fabric.setup(make_mlp())
    fabric.load(path, {"model": model})
    fabric.save(tmp_path / "single", {"model": model}, format="huggingface")
    sharded = fsdp_fabric.setup(make_mlp())
    fsdp_fabric.load(path, {"model": sharded})
    fsdp_fabric.save(tmp_path / "fsdp", {"model": sharded}, format="huggingface")
    for folder in ("single", "fsdp"):
        target = fsdp_fabric.setup(make_mlp())
        fsdp_fabric.load(tmp_path / folder, {"model": target})
        assert all(torch.equal(a, b) for a, b in zip(full_parameters(target), saved, strict=True)), folder
        read = "from safetensors.torch import load_file; import sys; w = load_file(sys.argv[1]); print(sorted(w))"
        done = subprocess.run(
            [sys.executable, "-c", read, str(tmp_path / folder / "model-00001-of-00001.safetensors")],
            capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == str(sorted(make_mlp().state_dict())), folder


# --- torch.compile -----------------------------------------------------------------------------------------------


def test_setup_with_compile_gives_the_outputs_and_training_of_eager() -> None:
    torch._dynamo.reset()
    fabric = Fabric(accelerator="cuda", devices=1)
    torch.manual_seed(0)
    init = make_mlp()
    eager_model, compiled_model = copy.deepcopy(init), copy.deepcopy(init)
    eager, eager_optimizer = fabric.setup(eager_model, torch.optim.SGD(eager_model.parameters(), lr=LR))
    compiled, compiled_optimizer = fabric.setup(
        compiled_model, torch.optim.SGD(compiled_model.parameters(), lr=LR), compile=True
    )
    assert type(compiled._forward_module).__name__ == "OptimizedModule"
    x, y = regression_data(CUDA)
    torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-6)

    eager_losses = train(eager, eager_optimizer, x, y, backward=fabric.backward)
    compiled_losses = train(compiled, compiled_optimizer, x, y, backward=fabric.backward)
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-5, abs=1e-6)
    difference = max_difference(full_parameters(compiled), full_parameters(eager))
    assert difference <= 1e-5
    assert max_difference(full_parameters(compiled), full_parameters(init)) > 1e-2  # it trained
    torch._dynamo.reset()


# --- a GPU checkpoint on a CPU-only machine ------------------------------------------------------------------

_LOAD_ON_CPU = """
import sys

import torch
from gpu_tools import make_mlp

from fabric import Fabric

assert not torch.cuda.is_available(), "CUDA_VISIBLE_DEVICES='' should hide every GPU"
fabric = Fabric()
assert fabric.device.type == "cpu", fabric.device
model = make_mlp()
model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
state = {"model": model, "optimizer": optimizer, "step": 0}
fabric.load(sys.argv[1], state)
assert {parameter.device.type for parameter in model.parameters()} == {"cpu"}
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": state["step"]}, sys.argv[2])
"""


def test_a_checkpoint_of_gpu_tensors_loads_in_a_cpu_only_process(
    gpu_checkpoint: tuple[Path, list[torch.Tensor]], tmp_path: Path
) -> None:
    path, saved = gpu_checkpoint
    on_gpu = torch.load(path, weights_only=True)
    # fabric.save keeps GPU tensors where they are (so a plain torch.load needs a GPU): what this test is about
    assert {tensor.device.type for tensor in on_gpu["model"].values()} == {"cuda"}
    output = tmp_path / "loaded_on_cpu.pt"
    paths = [str(ROOT), str(Path(__file__).parent), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(paths)}
    result = subprocess.run(
        [sys.executable, "-c", _LOAD_ON_CPU, str(path), str(output)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = torch.load(output, weights_only=True)
    assert loaded["step"] == 3
    assert all(torch.equal(a, b) for a, b in zip(loaded["model"].values(), saved, strict=True))
    gpu_state = on_gpu["optimizer"]["state"]
    for index, moments in loaded["optimizer"]["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert moments[name].device.type == "cpu"
            assert torch.equal(moments[name], gpu_state[index][name].cpu())


# --- FLOPs and MFU ---------------------------------------------------------------------------------------------


def test_measure_flops_and_the_throughput_monitors_mfu_against_the_gpus_peak() -> None:
    name = torch.cuda.get_device_name(CUDA)
    peak = device_peak_flops(name, torch.bfloat16)
    if peak is None:
        pytest.skip(f"no peak bf16 FLOP/s known for {name!r}: add it to PEAK_FLOPS in fabric/utilities/throughput.py")
    width, depth, batch = 4096, 4, 4096

    def make() -> nn.Module:
        return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(depth)))

    # forward: 2*b*w*w per layer; backward: the weight gradient of every layer, the input gradient of all but
    # the first (the input needs none)
    expected = 2 * batch * width * width * (depth + depth + depth - 1)
    with torch.device("meta"):
        meta_model, meta_x = make(), torch.randn(batch, width)
    assert measure_flops(meta_model, lambda: meta_model(meta_x), lambda y: y.sum()) == expected

    fabric = Fabric(accelerator="cuda", devices=1, precision="bf16-mixed")
    model = make()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1e-6))
    x = torch.randn(batch, width, device=CUDA)
    assert measure_flops(model, lambda: model(x), lambda y: y.sum()) == expected  # counted on the GPU too

    def step() -> None:
        loss = model(x).float().pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        fabric.backward(loss)
        optimizer.step()

    for _ in range(3):  # warm-up: cuBLAS handles and kernel choices
        step()
    monitor = ThroughputMonitor(fabric, available_flops=peak, window_size=20)
    torch.cuda.synchronize()
    start = time.perf_counter()
    monitor.update(time=0.0, batches=0, samples=0)
    steps = 20
    for index in range(1, steps + 1):
        step()
        torch.cuda.synchronize()
        monitor.update(time=time.perf_counter() - start, batches=index, samples=index * batch, flops=expected)
    metrics = monitor.compute_and_log(step=steps)
    elapsed = metrics["time"]
    assert metrics["device/flops_per_sec"] == pytest.approx(expected * steps / elapsed)
    mfu = metrics["device/mfu"]
    assert metrics["mfu"] == mfu
    assert 0 < mfu <= 1, f"MFU {mfu:.3f} on {name} with a peak of {peak / 1e12:.1f} TFLOP/s"
