"""CUDA code paths, with the CUDA runtime faked at its boundary (this machine has no GPU)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric
from fabric.accelerators import CUDAAccelerator
from fabric.plugins.precision import MixedPrecision


class FakeCuda:
    """Stands in for the ``torch.cuda`` functions Fabric calls, and records what was asked of them."""

    def __init__(self, count: int, bf16: bool = True) -> None:
        self.count = count
        self.bf16 = bf16
        self.current: list[torch.device] = []
        self.cache_emptied = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: self.count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: self.bf16)
        monkeypatch.setattr(torch.cuda, "set_device", self.current.append)
        monkeypatch.setattr(torch.cuda, "empty_cache", self._empty_cache)

    def _empty_cache(self) -> None:
        self.cache_emptied += 1


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda(count=1)
    fake.install(monkeypatch)
    return fake


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda(count=2)
    fake.install(monkeypatch)
    return fake


def test_auto_prefers_cuda_and_claims_the_device(one_gpu: FakeCuda) -> None:
    fabric = Fabric()
    assert isinstance(fabric.strategy.accelerator, CUDAAccelerator)
    assert fabric.device == torch.device("cuda", 0)
    assert one_gpu.current == [torch.device("cuda", 0)]


@pytest.mark.parametrize("accelerator", ["cuda", "gpu"])
def test_gpu_is_an_alias_for_an_available_cuda(one_gpu: FakeCuda, accelerator: str) -> None:
    assert isinstance(Fabric(accelerator=accelerator).strategy.accelerator, CUDAAccelerator)


@pytest.mark.parametrize("devices", [[1], "1,"])
def test_devices_by_index_pick_that_gpu(two_gpus: FakeCuda, devices: object) -> None:
    fabric = Fabric(accelerator="cuda", devices=devices)  # type: ignore[arg-type]
    assert fabric.device == torch.device("cuda", 1)
    assert two_gpus.current == [torch.device("cuda", 1)]


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        (3, r"devices=3 asks for CUDA device\(s\) \[0, 1, 2\], but this machine has 2"),
        ([2], r"devices=\[2\] asks for CUDA device\(s\) \[2\], but this machine has 2"),
    ],
)
def test_asking_for_more_gpus_than_exist_is_a_clear_error(two_gpus: FakeCuda, devices: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Fabric(accelerator="cuda", devices=devices)  # type: ignore[arg-type]


def test_bf16_on_a_gpu_without_bf16_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(count=1, bf16=False).install(monkeypatch)
    with pytest.raises(ValueError, match="precision='bf16-mixed' needs bfloat16, which this cuda device"):
        Fabric(accelerator="cuda", precision="bf16-mixed")
    assert Fabric(accelerator="cuda", precision="16-mixed").precision.name == "16-mixed"


def test_16_mixed_on_cuda_autocasts_cuda_and_scales_with_a_cuda_grad_scaler(one_gpu: FakeCuda) -> None:
    precision = Fabric(accelerator="cuda", precision="16-mixed").precision
    assert isinstance(precision, MixedPrecision)
    assert precision.device_type == "cuda"
    assert precision.scaler is not None and precision.scaler.is_enabled()
    assert precision.scaler._device == "cuda"


def test_dataloader_targets_the_gpu_and_teardown_frees_the_cache(one_gpu: FakeCuda) -> None:
    fabric = Fabric(accelerator="cuda")
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.ones(2))))
    assert loader.device == torch.device("cuda", 0)
    fabric.strategy.teardown()
    assert one_gpu.cache_emptied == 1
