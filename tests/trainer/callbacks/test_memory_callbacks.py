"""MemoryMonitor, OOMObserver and MemorySnapshot: CUDA faked at torch.cuda's boundary, the host's memory for real."""

from __future__ import annotations

import os
import pickle
import sys
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from monitor_rig import Regressor, Rig, fake_cuda_fabric, fit

from fabric.trainer.callbacks import MemoryMonitor, MemorySnapshot, OOMObserver
from fabric.trainer.core.events import Event

#: A memory snapshot as torch.cuda.memory._snapshot() returns it (the parts the visualisations read).
SNAPSHOT = {
    "segments": [
        {"device": 0, "address": 4096, "total_size": 2048, "stream": 0, "segment_type": "small", "blocks": []}
    ],
    "device_traces": [[{"action": "alloc", "addr": 4096, "size": 512, "stream": 0, "time_us": 1, "frames": []}]],
}


# --- MemoryMonitor ------------------------------------------------------------------------------------


def test_memory_monitor_logs_composers_cuda_names_in_gigabytes(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[torch.device] = []

    def memory_stats(device: torch.device) -> dict[str, int]:
        asked.append(device)
        return {
            "allocated_bytes.all.current": 1_500_000_000,
            "allocated_bytes.all.peak": 3_000_000_000,
            "active_bytes.all.current": 1_600_000_000,
            "active_bytes.all.peak": 3_100_000_000,
            "inactive_split_bytes.all.current": 100_000_000,
            "inactive_split_bytes.all.peak": 200_000_000,
            "reserved_bytes.all.current": 4_000_000_000,
            "reserved_bytes.all.peak": 5_000_000_000,
            "num_alloc_retries": 2,
            "num_ooms": 0,  # not one of the logged keys
        }

    monkeypatch.setattr(torch.cuda, "memory_stats", memory_stats)
    rig = Rig(MemoryMonitor(), fabric=SimpleNamespace(device=torch.device("cuda", 1)))
    rig.run(Event.AFTER_TRAIN_BATCH)
    assert asked == [torch.device("cuda", 1)]
    assert rig.memory.most_recent_values == {
        "memory/current_allocated_mem": pytest.approx(1.5),
        "memory/current_active_mem": pytest.approx(1.6),
        "memory/current_inactive_mem": pytest.approx(0.1),
        "memory/current_reserved_mem": pytest.approx(4.0),
        "memory/peak_allocated_mem": pytest.approx(3.0),
        "memory/peak_active_mem": pytest.approx(3.1),
        "memory/peak_inactive_mem": pytest.approx(0.2),
        "memory/peak_reserved_mem": pytest.approx(5.0),
        "memory/alloc_retries": 2.0,  # a count, not bytes
    }
    assert rig.steps("memory/current_reserved_mem") == [1]  # the step of the batch being trained


def test_memory_monitor_memory_keys_replace_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: {"allocated_bytes.all.current": 2e9, "x": 1})
    rig = Rig(MemoryMonitor(memory_keys={"allocated_bytes.all.current": "mine"}), fabric=fake_cuda_fabric())
    rig.run(Event.AFTER_TRAIN_BATCH)
    assert rig.memory.most_recent_values == {"memory/mine": pytest.approx(2.0)}


def test_memory_monitor_logs_the_process_rss_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    resource = pytest.importorskip("resource")
    monkeypatch.setattr(resource, "getrusage", lambda who: SimpleNamespace(ru_maxrss=3_000_000))
    rig = Rig(MemoryMonitor())  # no Fabric: the model's parameters are on the CPU
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rig.run(Event.AFTER_TRAIN_BATCH)
    values = rig.memory.most_recent_values
    assert set(values) == {"memory/current_rss_mem", "memory/peak_rss_mem"}
    peak_bytes = 3_000_000 * (1 if sys.platform == "darwin" else 1024)
    assert values["memory/peak_rss_mem"] == pytest.approx(peak_bytes / 1e9)
    psutil = pytest.importorskip("psutil")
    assert values["memory/current_rss_mem"] == pytest.approx(psutil.Process().memory_info().rss / 1e9, rel=0.05)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc")
def test_memory_monitor_reads_proc_without_psutil(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil raises ImportError
    rig = Rig(MemoryMonitor())
    rig.run(Event.AFTER_TRAIN_BATCH)
    with open("/proc/self/statm") as statm:
        resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert rig.memory.most_recent_values["memory/current_rss_mem"] == pytest.approx(resident / 1e9, rel=0.05)


def test_memory_monitor_aggregates_over_ranks_every_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: {"reserved_bytes.all.current": 4e9})
    reductions: list[str] = []

    def all_reduce(values: torch.Tensor, reduce_op: str) -> torch.Tensor:
        reductions.append(reduce_op)
        other_rank = torch.full_like(values, 2.0)  # rank 1 reserved 2 GB
        return {"mean": (values + other_rank) / 2, "min": torch.minimum(values, other_rank)}.get(
            reduce_op, torch.maximum(values, other_rank)
        )

    fabric = fake_cuda_fabric(world_size=2, all_reduce=all_reduce)
    rig = Rig(MemoryMonitor(dist_aggregate_batch_interval=2), fabric=fabric)
    for _ in range(3):  # batches 0, 1, 2: aggregated at 0 and 2, as Composer counts
        rig.run(Event.AFTER_TRAIN_BATCH)
        rig.advance()
    assert reductions == ["mean", "min", "max"] * 2
    assert rig.steps("memory/current_reserved_mem_avg") == [1, 3]
    assert rig.memory.most_recent_values["memory/current_reserved_mem_avg"] == pytest.approx(3.0)
    assert rig.memory.most_recent_values["memory/current_reserved_mem_min"] == pytest.approx(2.0)
    assert rig.memory.most_recent_values["memory/current_reserved_mem_max"] == pytest.approx(4.0)
    assert rig.steps("memory/current_reserved_mem") == [1, 2, 3]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"memory_keys": {}}, "memory_keys must map"),
        ({"memory_keys": {"allocated_bytes.all.current": 3}}, "memory_keys must map"),
        (
            {"dist_aggregate_batch_interval": 0},
            "dist_aggregate_batch_interval must be a whole number, at least 1; got 0",
        ),
    ],
)
def test_memory_monitor_rejects_bad_arguments(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MemoryMonitor(**arguments)


def test_memory_monitor_in_a_cpu_fit_logs_rss_every_batch() -> None:
    memory = fit(Regressor(), [MemoryMonitor()])
    assert [step for step, _ in memory.data["memory/current_rss_mem"]] == [1, 2, 3, 4, 5, 6]
    currents, peaks = memory.data["memory/current_rss_mem"], memory.data["memory/peak_rss_mem"]
    for (_, current), (_, peak) in zip(currents, peaks, strict=True):
        assert 0 < current <= peak


# --- OOMObserver --------------------------------------------------------------------------------------


class FakeCudaMemory:
    """torch.cuda's memory-history functions, recording what the callbacks ask of them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, snapshot: dict[str, Any] = SNAPSHOT) -> None:
        self.history: list[dict[str, Any]] = []
        self.observers: list[Any] = []
        self.snapshots = 0
        self.snapshot = snapshot
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", self._record)
        monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", self.observers.append, raising=False)
        monkeypatch.setattr(torch.cuda.memory, "_snapshot", self._snapshot)

    def _record(self, **arguments: Any) -> None:
        self.history.append(arguments)

    def _snapshot(self) -> dict[str, Any]:
        self.snapshots += 1
        return self.snapshot


def test_oom_observer_records_history_and_dumps_the_snapshot_on_out_of_memory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    cuda = FakeCudaMemory(monkeypatch)
    observer = OOMObserver(max_entries=500, folder=str(tmp_path / "{run_name}" / "oom"), filename="rank{rank}_oom")
    rig = Rig(observer, fabric=fake_cuda_fabric(rank=3))
    rig.run(Event.INIT, Event.FIT_START)
    assert cuda.history == [{"enabled": "all", "max_entries": 500}]
    assert len(cuda.observers) == 1 and cuda.snapshots == 0

    with pytest.warns(UserWarning, match=r"CUDA out of memory on device 0 \(asked for 1024 bytes.*rank3_oom"):
        cuda.observers[0](0, 1024, 7000, 10)  # what the allocator calls before raising OutOfMemoryError
    prefix = tmp_path / "the-run" / "oom" / "rank3_oom"
    with open(f"{prefix}_snapshot.pickle", "rb") as file:
        assert pickle.load(file) == SNAPSHOT
    for page in ("_trace_plot.html", "_segment_plot.html"):
        assert "<html" in (tmp_path / "the-run" / "oom" / f"rank3_oom{page}").read_text().lower()
    assert observer.written == [f"{prefix}_snapshot.pickle", f"{prefix}_trace_plot.html", f"{prefix}_segment_plot.html"]

    observer.close()
    assert cuda.history[-1] == {"enabled": None}
    cuda.observers[0](0, 1024, 7000, 10)  # attached for good, but closed: does nothing
    assert cuda.snapshots == 1


def test_oom_observer_refuses_to_overwrite_an_earlier_runs_snapshot(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    cuda = FakeCudaMemory(monkeypatch)
    (tmp_path / "rank0_oom_snapshot.pickle").write_bytes(b"earlier")
    with pytest.raises(FileExistsError, match=r"rank0_oom_snapshot\.pickle.*overwrite=True"):
        Rig(OOMObserver(folder=str(tmp_path)), fabric=fake_cuda_fabric()).run(Event.INIT)
    assert cuda.history == [] and cuda.observers == []
    Rig(OOMObserver(folder=str(tmp_path), overwrite=True), fabric=fake_cuda_fabric()).run(Event.INIT)
    assert len(cuda.observers) == 1


def test_oom_observer_never_raises_from_the_allocator(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    cuda = FakeCudaMemory(monkeypatch)
    rig = Rig(OOMObserver(folder=str(tmp_path / "gone")), fabric=fake_cuda_fabric())
    rig.run(Event.INIT)
    os.rmdir(tmp_path / "gone")
    with pytest.warns(UserWarning, match="could not write the memory snapshot"):
        cuda.observers[0](0, 1, 2, 3)


def test_oom_observer_warns_once_and_does_nothing_on_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    cuda = FakeCudaMemory(monkeypatch)
    rig = Rig(OOMObserver(folder=str(tmp_path / "traces")))
    with pytest.warns(UserWarning, match="OOMObserver needs CUDA, but the model trains on cpu") as caught:
        rig.run(Event.INIT, Event.FIT_START, Event.FIT_START)
    assert len(caught) == 1
    assert cuda.history == [] and cuda.observers == []
    assert not (tmp_path / "traces").exists()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"remote_file_name": "{run_name}/oom"}, "remote_file_name='{run_name}/oom' is not supported"),
        ({"max_entries": 0}, "max_entries must be a whole number, at least 1; got 0"),
        ({"folder": "{run_name}/{batch}"}, r"folder='{run_name}/{batch}' uses \['batch'\]"),
        ({"filename": "oom/{rank}"}, "must be a file name without folders"),
        ({"filename": "{user}"}, r"uses \['user'\]; the fields it may use are"),
        ({"overwrite": "yes"}, "overwrite must be True or False"),
    ],
)
def test_oom_observer_rejects_bad_arguments(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OOMObserver(**arguments)


# --- MemorySnapshot -----------------------------------------------------------------------------------


def test_memory_snapshot_records_the_window_after_the_skipped_batches(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    cuda = FakeCudaMemory(monkeypatch)
    callback = MemorySnapshot(skip_batches=2, interval="3ba", max_entries=77, folder=str(tmp_path / "{run_name}"))
    rig = Rig(callback, fabric=fake_cuda_fabric(rank=1))
    rig.run(Event.INIT)
    started_at, stopped_at = None, None
    for batch in range(1, 9):
        rig.batch()
        if cuda.history and started_at is None:
            started_at = batch
        if len(cuda.history) == 2 and stopped_at is None:
            stopped_at = batch
    assert cuda.history == [{"enabled": "all", "max_entries": 77}, {"enabled": None}]
    assert (started_at, stopped_at) == (3, 5)  # batches 1-2 skipped; 3, 4, 5 recorded
    prefix = tmp_path / "the-run" / "rank1.5.memory_snapshot"
    with open(f"{prefix}.pickle", "rb") as file:
        assert pickle.load(file) == SNAPSHOT
    assert "<html" in (tmp_path / "the-run" / "rank1.5.memory_snapshot.html").read_text().lower()
    assert callback.written == [f"{prefix}.pickle", f"{prefix}.html"]
    assert cuda.snapshots == 1  # once per callback


def test_memory_snapshot_in_epochs_writes_nothing_when_nothing_was_recorded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    cuda = FakeCudaMemory(monkeypatch, snapshot={"segments": [], "device_traces": [[]]})
    rig = Rig(MemorySnapshot(skip_batches=0, interval="1ep", folder=str(tmp_path)), fabric=fake_cuda_fabric())
    rig.batch()
    rig.batch()
    assert cuda.history == [{"enabled": "all", "max_entries": 100_000}]  # the epoch is not over
    rig.state.timestamp = rig.state.timestamp.to_next_epoch()
    with pytest.warns(UserWarning, match="recorded no allocation"):
        rig.batch()
    assert cuda.history[-1] == {"enabled": None}
    assert list(tmp_path.iterdir()) == []


def test_memory_snapshot_leaves_existing_files_unless_told(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    FakeCudaMemory(monkeypatch)
    (tmp_path / "snap.pickle").write_bytes(b"earlier")
    rig = Rig(MemorySnapshot(0, 1, folder=str(tmp_path), filename="snap"), fabric=fake_cuda_fabric())
    with pytest.warns(UserWarning, match="snap.pickle.*overwrite=True"):
        rig.batch()
    assert (tmp_path / "snap.pickle").read_bytes() == b"earlier"
    rig = Rig(MemorySnapshot(0, 1, folder=str(tmp_path), filename="snap", overwrite=True), fabric=fake_cuda_fabric())
    rig.batch()
    with open(tmp_path / "snap.pickle", "rb") as file:
        assert pickle.load(file) == SNAPSHOT


def test_memory_snapshot_close_stops_a_recording_cut_short(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    cuda = FakeCudaMemory(monkeypatch)
    callback = MemorySnapshot(skip_batches=0, interval=10, folder=str(tmp_path))
    rig = Rig(callback, fabric=fake_cuda_fabric())
    rig.batch()
    callback.close()
    assert cuda.history == [{"enabled": "all", "max_entries": 100_000}, {"enabled": None}]
    assert cuda.snapshots == 0


def test_memory_snapshot_warns_once_and_does_nothing_on_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    cuda = FakeCudaMemory(monkeypatch)
    with pytest.warns(UserWarning, match="MemorySnapshot needs CUDA, but the model trains on cpu") as caught:
        memory = fit(Regressor(), [MemorySnapshot(skip_batches=0, interval=1, folder=str(tmp_path))])
    assert len([warning for warning in caught if "MemorySnapshot" in str(warning.message)]) == 1
    assert cuda.history == [] and list(tmp_path.iterdir()) == []
    assert len(memory.data["loss/train/total"]) == 6  # training went on


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"skip_batches": -1}, "skip_batches must be a whole number, at least 0; got -1"),
        ({"interval": "0ba"}, "interval='0ba' is not an interval; accepted: a positive 'Nba' or 'Nep'"),
        ({"interval": "100sp"}, "interval='100sp' is not an interval"),
        ({"interval": "often"}, "interval='often' is not an interval"),
        ({"max_entries": 1.5}, "max_entries must be a whole number"),
        ({"remote_file_name": "bucket/traces"}, "remote_file_name='bucket/traces' is not supported"),
        ({"filename": "a/b"}, "must be a file name without folders"),
    ],
)
def test_memory_snapshot_rejects_bad_arguments(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MemorySnapshot(**arguments)


# --- all of them --------------------------------------------------------------------------------------


def test_the_monitoring_callbacks_register_without_hook_warnings(tmp_path: Any) -> None:
    from fabric.trainer.callbacks import ActivationMonitor, ExportForInference, OptimizerMonitor, SystemMetricsMonitor

    pytest.importorskip("psutil")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Rig(
            MemoryMonitor(),
            OOMObserver(),
            MemorySnapshot(),
            SystemMetricsMonitor(),
            OptimizerMonitor(),
            ActivationMonitor(),
            ExportForInference("torchexport", save_folder=str(tmp_path)),
        )
