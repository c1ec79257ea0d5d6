"""``fabric.utilities.throughput``: FLOPs counted by torch's flop counter, rates over a window, logging from a loop."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.loggers.logger import Logger
from fabric.utilities.throughput import Throughput, ThroughputMonitor, measure_flops

B, IN, OUT = 8, 16, 4


def test_the_forward_of_a_linear_layer_is_2_b_in_out_flops() -> None:
    model = nn.Linear(IN, OUT, bias=False)
    x = torch.randn(B, IN)
    assert measure_flops(model, lambda: model(x)) == 2 * B * IN * OUT


def test_forward_and_backward_count_the_gradients_that_are_computed() -> None:
    model = nn.Linear(IN, OUT, bias=False)
    x = torch.randn(B, IN)
    # backward: the weight's gradient (2*B*IN*OUT); the input needs none
    assert measure_flops(model, lambda: model(x), lambda y: y.sum()) == 4 * B * IN * OUT
    x.requires_grad_(True)  # now also the input's gradient
    assert measure_flops(model, lambda: model(x), lambda y: y.sum()) == 6 * B * IN * OUT


def test_measuring_leaves_the_model_gradients_as_they_were() -> None:
    model = nn.Linear(IN, OUT)
    measure_flops(model, lambda: model(torch.randn(B, IN)), lambda y: y.sum())
    assert model.weight.grad is None and model.bias.grad is None
    model(torch.randn(B, IN)).sum().backward()
    before = model.weight.grad.clone()
    measure_flops(model, lambda: model(torch.randn(B, IN)), lambda y: y.sum())
    assert torch.equal(model.weight.grad, before)


def test_flops_on_the_meta_device_need_no_computation() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(IN, 32), nn.ReLU(), nn.Linear(32, OUT))
        x = torch.randn(B, IN)
    assert measure_flops(model, lambda: model(x)) == 2 * B * (IN * 32 + 32 * OUT)


def test_rates_are_over_the_window_of_updates() -> None:
    throughput = Throughput(available_flops=100.0, world_size=2, window_size=2)
    throughput.update(time=0.0, batches=0, samples=0, lengths=0)
    assert "device/samples_per_sec" not in throughput.compute()  # one record: no interval yet
    throughput.update(time=2.0, batches=1, samples=8, lengths=80, flops=60.0)
    throughput.update(time=3.0, batches=2, samples=16, lengths=160, flops=60.0)
    metrics = throughput.compute()
    assert metrics["device/samples_per_sec"] == pytest.approx(16 / 3)
    assert metrics["samples_per_sec"] == pytest.approx(2 * 16 / 3)  # both devices
    assert metrics["device/items_per_sec"] == pytest.approx(160 / 3)
    assert metrics["device/flops_per_sec"] == pytest.approx(120 / 3)
    assert metrics["device/mfu"] == metrics["mfu"] == pytest.approx(40 / 100)
    assert (metrics["time"], metrics["batches"], metrics["samples"], metrics["lengths"]) == (3.0, 2, 16, 160)
    throughput.update(time=7.0, batches=3, samples=24, lengths=240, flops=60.0)  # the first interval leaves
    metrics = throughput.compute()
    assert metrics["device/batches_per_sec"] == pytest.approx(2 / 5)
    assert metrics["device/flops_per_sec"] == pytest.approx(120 / 5)


def test_totals_must_not_go_backwards_and_arguments_are_checked() -> None:
    throughput = Throughput()
    throughput.update(time=2.0, batches=1, samples=4)
    with pytest.raises(ValueError, match=r"time=1.0\) takes running totals, .* previous update had time=2.0"):
        throughput.update(time=1.0, batches=2, samples=8)
    with pytest.raises(ValueError, match=r"lengths=...\) must be given at every update or at none"):
        throughput.update(time=3.0, batches=2, samples=8, lengths=10)
    with pytest.raises(ValueError, match="window_size must be an int >= 1; got 0"):
        Throughput(window_size=0)
    with pytest.raises(ValueError, match="available_flops must be a device's peak FLOP/s"):
        Throughput(available_flops=-1.0)


@pytest.mark.parametrize(
    ("update", "message"),
    [
        ({"time": 2.0, "batches": 2, "samples": 8, "lengths": 80}, r"time=2.0\) .* must grow .* had time=2.0"),
        ({"time": 3.0, "batches": 1, "samples": 8, "lengths": 80}, r"batches=1\) .* must grow .* had batches=1"),
        ({"time": 3.0, "batches": 2, "samples": 3, "lengths": 80}, r"samples=3\) .* must grow .* had samples=4"),
        ({"time": 3.0, "batches": 2, "samples": 8, "lengths": 40}, r"lengths=40\) .* must grow .* had lengths=40"),
        ({"time": 3.0, "batches": 9, "samples": 8, "lengths": 80}, r"batches=9, samples=8\): fewer samples than"),
        ({"time": 3.0, "batches": 2, "samples": 8, "lengths": 7}, r"samples=8, lengths=7\): fewer items than"),
        ({"time": 3.0, "batches": 2, "samples": 8, "lengths": 80, "flops": -1.0}, r"flops=-1.0\): expected a"),
        ({"time": float("nan"), "batches": 2, "samples": 8, "lengths": 80}, r"time=nan\): expected a number"),
    ],
)
def test_totals_that_stay_flat_or_contradict_each_other_are_refused(update: dict[str, float], message: str) -> None:
    """Lightning raises on each: flat totals gave rates of 0, falling ones negative rates."""
    throughput = Throughput()
    throughput.update(time=2.0, batches=1, samples=4, lengths=40)
    with pytest.raises(ValueError, match=message):
        throughput.update(**update)
    throughput.update(time=3.0, batches=2, samples=8, lengths=80)  # the refused update left nothing behind
    assert throughput.compute()["device/samples_per_sec"] == pytest.approx(4.0)


class _Recorder(Logger):
    def __init__(self) -> None:
        self.logged: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any) -> None:
        pass


def test_the_monitor_logs_from_a_fabric_loop() -> None:
    recorder = _Recorder()
    fabric = Fabric(accelerator="cpu", devices=1, loggers=[recorder])
    model = fabric.setup(nn.Linear(IN, OUT))
    x = torch.randn(B, IN)
    flops = measure_flops(model, lambda: model(x), lambda y: y.sum())
    monitor = ThroughputMonitor(fabric, available_flops=1e9, window_size=10)
    for step in range(4):
        model(x).sum().backward()
        monitor.update(time=float(step), batches=step, samples=step * B, flops=flops if step else None)
        monitor.compute_and_log()
    assert [step for step, _ in recorder.logged] == [0, 1, 2, 3]
    last = recorder.logged[-1][1]
    assert last["samples_per_sec"] == pytest.approx(B)  # 3 batches of B in 3 seconds
    assert last["flops_per_sec"] == pytest.approx(flops)
    assert last["mfu"] == pytest.approx(flops / 1e9)
