"""SystemMetricsMonitor: Composer's names, psutil for real and faked, the GPUs faked at torch.cuda's boundary."""

from __future__ import annotations

import sys
from collections import namedtuple
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from monitor_rig import Regressor, Rig, fake_cuda_fabric, fit

from fabric.trainer.callbacks import SystemMetricsMonitor
from fabric.trainer.core.events import Event

Memory = namedtuple("Memory", "total available percent used free")
Disk = namedtuple("Disk", "total used free percent")
Network = namedtuple("Network", "bytes_sent bytes_recv")
NETWORK = Network(10, 20)


def _fake_psutil(network: Any = NETWORK) -> SimpleNamespace:
    readings = iter([0.0, 37.5])  # the priming call at construction, then the batch's

    def cpu_percent(interval: float | None = None) -> float:
        assert interval is None  # never blocks the training loop
        return next(readings)

    return SimpleNamespace(
        cpu_percent=cpu_percent,
        virtual_memory=lambda: Memory(16e9, 6e9, 62.5, 9e9, 1e9),
        disk_usage=lambda path: Disk(100e9, 40e9, 60e9, 40.0),
        net_io_counters=lambda: network,
    )


def test_logs_the_nodes_cpu_memory_disk_and_network_under_composers_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psutil", _fake_psutil())
    rig = Rig(SystemMetricsMonitor())
    rig.run(Event.INIT)
    rig.batch()
    assert rig.memory.most_recent_values == {
        "cpu_percentage": 37.5,
        "cpu_memory_total": 16e9,
        "cpu_memory_available": 6e9,
        "cpu_memory_percent": 62.5,
        "cpu_memory_used": 9e9,
        "cpu_memory_free": 1e9,
        "disk_memory_total": 100e9,
        "disk_memory_used": 40e9,
        "disk_memory_free": 60e9,
        "disk_memory_percent": 40.0,
        "network_bytes_sent": 10.0,
        "network_bytes_recv": 20.0,
    }
    assert rig.steps("cpu_percentage") == [1]


def test_a_machine_without_network_interfaces_logs_no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psutil", _fake_psutil(network=None))
    rig = Rig(SystemMetricsMonitor())
    rig.batch()
    assert "cpu_percentage" in rig.memory.most_recent_values
    assert not any(name.startswith("network_") for name in rig.memory.most_recent_values)


def test_refuses_at_construction_without_psutil(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil raises ImportError
    with pytest.raises(ModuleNotFoundError, match="psutil, which is not installed: pip install psutil"):
        SystemMetricsMonitor()


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, utilization: float = 80.0) -> list[torch.device]:
    asked: list[torch.device] = []

    def utilization_of(device: torch.device) -> float:
        asked.append(device)
        return utilization

    monkeypatch.setattr(torch.cuda, "utilization", utilization_of)
    monkeypatch.setattr(torch.cuda, "memory_usage", lambda device: 30)
    monkeypatch.setattr(torch.cuda, "temperature", lambda device: 65)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda device: 250_500)  # milliwatts
    return asked


def test_on_cuda_logs_the_gpus_load_as_min_and_max_over_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("psutil")
    asked = _fake_gpu(monkeypatch)
    rig = Rig(SystemMetricsMonitor(), fabric=fake_cuda_fabric())
    rig.run(Event.INIT)
    rig.batch()
    values = rig.memory.most_recent_values
    assert {name: value for name, value in values.items() if "_rank_" in name} == {
        "min_gpu_percentage_rank_0": 80.0,
        "max_gpu_percentage_rank_0": 80.0,
        "min_memory_percentage_rank_0": 30.0,
        "max_memory_percentage_rank_0": 30.0,
        "min_gpu_temperature_C_rank_0": 65.0,
        "max_gpu_temperature_C_rank_0": 65.0,
        "min_gpu_power_usage_W_rank_0": pytest.approx(250.5),
        "max_gpu_power_usage_W_rank_0": pytest.approx(250.5),
    }
    assert "cpu_percentage" in values
    assert asked == [torch.device("cuda", 0)] * 2  # checked at INIT, read at BATCH_END


@pytest.mark.parametrize("log_all_data", [False, True])
def test_on_several_ranks_the_gpu_metrics_are_gathered(monkeypatch: pytest.MonkeyPatch, log_all_data: bool) -> None:
    pytest.importorskip("psutil")
    _fake_gpu(monkeypatch, utilization=80.0)
    gathered: list[torch.Tensor] = []

    def all_gather(values: torch.Tensor) -> torch.Tensor:
        gathered.append(values)
        other_ranks = [torch.tensor([95.0, 10.0, 70.0, 300.0]), torch.tensor([20.0, 50.0, 60.0, 100.0])]
        return torch.stack([values, *other_ranks])

    rig = Rig(
        SystemMetricsMonitor(log_all_data=log_all_data), fabric=fake_cuda_fabric(world_size=3, all_gather=all_gather)
    )
    rig.batch()
    assert len(gathered) == 1
    gpu = {name: value for name, value in rig.memory.most_recent_values.items() if "_rank_" in name}
    if log_all_data:
        assert gpu["gpu_percentage_rank_0"] == 80.0 and gpu["gpu_percentage_rank_1"] == 95.0
        assert gpu["gpu_power_usage_W_rank_2"] == pytest.approx(100.0)
        assert len(gpu) == 4 * 3
    else:
        assert gpu["min_gpu_percentage_rank_2"] == 20.0 and gpu["max_gpu_percentage_rank_1"] == 95.0
        assert gpu["min_memory_percentage_rank_1"] == 10.0 and gpu["max_memory_percentage_rank_2"] == 50.0
        assert gpu["max_gpu_power_usage_W_rank_1"] == pytest.approx(300.0)
        assert len(gpu) == 4 * 2


def test_on_cuda_without_nvml_bindings_refuses_when_the_trainer_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("psutil")

    def utilization(device: torch.device) -> float:
        raise ModuleNotFoundError("pynvml does not seem to be installed or it can't be imported.")

    monkeypatch.setattr(torch.cuda, "utilization", utilization)
    rig = Rig(SystemMetricsMonitor(), fabric=fake_cuda_fabric())
    with pytest.raises(ModuleNotFoundError, match=r"NVML.*pynvml does not seem.*: pip install nvidia-ml-py"):
        rig.run(Event.INIT)


def test_rejects_bad_arguments() -> None:
    pytest.importorskip("psutil")
    with pytest.raises(ValueError, match="log_all_data must be True or False; got 'all'"):
        SystemMetricsMonitor(log_all_data="all")  # type: ignore[arg-type]


def test_in_a_cpu_fit_the_real_psutil_readings_are_logged_every_batch() -> None:
    psutil = pytest.importorskip("psutil")
    memory = fit(Regressor(), [SystemMetricsMonitor()])
    for name in ("cpu_percentage", "cpu_memory_available", "cpu_memory_total", "disk_memory_used"):
        assert [step for step, _ in memory.data[name]] == [1, 2, 3, 4, 5, 6], name
    assert memory.most_recent_values["cpu_memory_total"] == psutil.virtual_memory().total
    assert 0 <= memory.most_recent_values["cpu_percentage"] <= 100
    assert not any("gpu" in name for name in memory.data)
