"""Throughput of a training loop: batches, samples, items (tokens) and FLOPs per second, and MFU.

- :func:`measure_flops` counts the FLOPs of one forward (and backward) with ``torch.utils.flop_counter``.
- :class:`Throughput` turns running totals, recorded once per step, into rates over a window of steps.
- :class:`ThroughputMonitor` is a :class:`Throughput` that logs through a ``Fabric``'s loggers.

The Trainer's :class:`~fabric.trainer.callbacks.SpeedMonitor` computes its rates with :class:`Throughput`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

#: Peak dense (no sparsity) tensor-core FLOP/s per dtype of data-centre GPUs, from NVIDIA's datasheets, by a
#: lower-case fragment of ``torch.cuda.get_device_name()``. The first fragment found in the name wins, so the
#: more specific ones come first ("gh200" before "h200", "l40s" before "l40" before "l4").
PEAK_FLOPS: tuple[tuple[str, dict[torch.dtype, float]], ...] = (
    ("b200", {torch.bfloat16: 2250e12, torch.float16: 2250e12}),
    ("gh200", {torch.bfloat16: 989.5e12, torch.float16: 989.5e12, torch.float32: 67e12}),
    ("h200 nvl", {torch.bfloat16: 835.5e12, torch.float16: 835.5e12, torch.float32: 60e12}),
    ("h200", {torch.bfloat16: 989.5e12, torch.float16: 989.5e12, torch.float32: 67e12}),
    ("h100 nvl", {torch.bfloat16: 835.5e12, torch.float16: 835.5e12, torch.float32: 60e12}),
    ("h100 pcie", {torch.bfloat16: 756e12, torch.float16: 756e12, torch.float32: 51e12}),
    ("h100", {torch.bfloat16: 989.5e12, torch.float16: 989.5e12, torch.float32: 67e12}),  # SXM: "H100 80GB HBM3"
    ("a100", {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12}),
    ("l40s", {torch.bfloat16: 362.05e12, torch.float16: 362.05e12, torch.float32: 91.6e12}),
    ("l40", {torch.bfloat16: 181.05e12, torch.float16: 181.05e12, torch.float32: 90.5e12}),
    ("l4", {torch.bfloat16: 121e12, torch.float16: 121e12, torch.float32: 30.3e12}),
)


def device_peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """The peak FLOP/s of the GPU called ``device_name`` (``torch.cuda.get_device_name()``) in ``dtype``, or None
    when the table does not know it: what ``Throughput(available_flops=)`` and ``SpeedMonitor`` take for MFU."""
    name = device_name.lower()
    for fragment, peaks in PEAK_FLOPS:
        if fragment in name:
            return peaks.get(dtype)
    return None


def measure_flops(
    model: nn.Module,
    forward_fn: Callable[[], torch.Tensor],
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> int:
    """FLOPs of ``forward_fn()``, and of the backward of ``loss_fn(output)`` when ``loss_fn`` is given.

    Counts what actually runs, so the backward counts input gradients only for inputs that require
    them. ``model``'s gradients are left as they were (the backward's are discarded). Build the model
    and inputs on the meta device (``with torch.device("meta"):``) to count without computing.
    """
    from torch.utils.flop_counter import FlopCounterMode

    parameters = list(model.parameters())
    saved_grads = [parameter.grad for parameter in parameters]
    for parameter in parameters:  # the backward writes new gradients, not into the saved ones
        parameter.grad = None
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            output = forward_fn()
            if loss_fn is not None:
                loss_fn(output).backward()  # type: ignore[no-untyped-call]
    finally:
        for parameter, grad in zip(parameters, saved_grads, strict=True):
            parameter.grad = grad
    return int(counter.get_total_flops())


class _Record(NamedTuple):
    time: float
    batches: float
    samples: float
    lengths: float | None
    flops: float | None


def _check_record(record: _Record) -> None:
    """One update's totals must be consistent with each other."""
    for name in ("time", "batches", "samples", "lengths", "flops"):
        value = getattr(record, name)
        if value is not None and not value >= 0:
            raise ValueError(f"Throughput.update({name}={value!r}): expected a number >= 0.")
    if record.samples < record.batches:
        raise ValueError(
            f"Throughput.update(batches={record.batches}, samples={record.samples}): fewer samples than batches; "
            "every batch holds at least one sample."
        )
    if record.lengths is not None and record.lengths < record.samples:
        raise ValueError(
            f"Throughput.update(samples={record.samples}, lengths={record.lengths}): fewer items than samples; "
            "lengths counts the items (e.g. tokens) in the samples, at least one per sample."
        )


def _check_growth(before: _Record, after: _Record) -> None:
    """Running totals grow strictly from one update to the next; ``lengths`` is given always or never."""
    if (after.lengths is None) != (before.lengths is None):
        raise ValueError("Throughput.update(lengths=...) must be given at every update or at none.")
    for name in ("time", "batches", "samples", "lengths"):
        value, previous = getattr(after, name), getattr(before, name)
        if value is not None and value <= previous:
            raise ValueError(
                f"Throughput.update({name}={value}) takes running totals, which must grow between updates; "
                f"the previous update had {name}={previous}."
            )


class Throughput:
    """Rates from running totals, over the last ``window_size`` intervals between :meth:`update` calls.

    Args:
        available_flops: one device's peak FLOP/s (for MFU); ``None`` leaves MFU out.
        world_size: devices working alike; global rates are this device's times ``world_size``.
        window_size: how many intervals between updates the rates average over (fewer until there are).
        separator: between ``"device"`` and the metric name in :meth:`compute`'s keys.
    """

    def __init__(
        self, available_flops: float | None = None, world_size: int = 1, window_size: int = 100, separator: str = "/"
    ) -> None:
        if available_flops is not None and not (
            isinstance(available_flops, int | float) and 0 < available_flops < math.inf
        ):
            raise ValueError(f"available_flops must be a device's peak FLOP/s (> 0) or None; got {available_flops!r}.")
        for name, value in (("world_size", world_size), ("window_size", window_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1; got {value!r}.")
        self.available_flops = available_flops
        self.world_size = world_size
        self.separator = separator
        self._records: deque[_Record] = deque(maxlen=window_size + 1)

    def update(
        self,
        *,
        time: float,
        batches: float,
        samples: float,
        lengths: float | None = None,
        flops: float | None = None,
    ) -> None:
        """Record this device's totals since the start: ``time`` (seconds), ``batches``, ``samples``, and
        ``lengths`` (items, e.g. tokens); and ``flops``, this device's FLOPs since the previous update
        (e.g. :func:`measure_flops` times the batches run since then).

        Totals that stay flat or go down, fewer samples than batches or fewer items than samples are
        refused with a ``ValueError`` (they would give rates of 0 or below), as Lightning Fabric does.
        """
        record = _Record(time, batches, samples, lengths, flops)
        _check_record(record)
        if self._records:
            _check_growth(self._records[-1], record)
        self._records.append(record)

    def compute(self) -> dict[str, float]:
        """The totals, and once there are two updates, the rates over the window: ``device/batches_per_sec``,
        ``device/samples_per_sec``, ``device/items_per_sec`` (with lengths), ``device/flops_per_sec`` and
        ``device/mfu`` (with flops; MFU with ``available_flops``), and the same for all devices without the
        ``device/`` prefix."""
        if not self._records:
            return {}
        first, last = self._records[0], self._records[-1]
        metrics = {"time": last.time, "batches": last.batches, "samples": last.samples}
        if last.lengths is not None:
            metrics["lengths"] = last.lengths
        elapsed = last.time - first.time
        if elapsed <= 0:
            return metrics
        device = {
            "batches_per_sec": (last.batches - first.batches) / elapsed,
            "samples_per_sec": (last.samples - first.samples) / elapsed,
        }
        if last.lengths is not None and first.lengths is not None:
            device["items_per_sec"] = (last.lengths - first.lengths) / elapsed
        flops = [record.flops for record in list(self._records)[1:] if record.flops is not None]
        if flops:
            device["flops_per_sec"] = sum(flops) / elapsed
            if self.available_flops is not None:
                device["mfu"] = device["flops_per_sec"] / self.available_flops
        for name, value in device.items():
            metrics[f"device{self.separator}{name}"] = value
            metrics[name] = value if name == "mfu" else value * self.world_size
        return metrics

    def reset(self) -> None:
        self._records.clear()


class _LoggingFabric(Protocol):
    @property
    def world_size(self) -> int: ...

    def log_dict(self, metrics: Mapping[str, Any], step: int | None = None) -> None: ...


class ThroughputMonitor(Throughput):
    """A :class:`Throughput` for ``fabric``'s world size that logs with ``fabric.log_dict``.

    ::

        monitor = ThroughputMonitor(fabric, available_flops=peak_flops_per_device)
        start = time.perf_counter()
        for step, batch in enumerate(loader, 1):
            ...  # the training step
            monitor.update(time=time.perf_counter() - start, batches=step, samples=step * batch_size,
                           flops=flops_per_batch)
            monitor.compute_and_log(step=step)
    """

    def __init__(
        self, fabric: _LoggingFabric, available_flops: float | None = None, window_size: int = 100, separator: str = "/"
    ) -> None:
        super().__init__(available_flops, fabric.world_size, window_size, separator)
        self._fabric = fabric
        self.step = -1

    def compute_and_log(self, step: int | None = None) -> dict[str, float]:
        """:meth:`compute`, logged at ``step`` (by default one more than the last)."""
        self.step = self.step + 1 if step is None else step
        metrics = self.compute()
        self._fabric.log_dict(metrics, step=self.step)
        return metrics
