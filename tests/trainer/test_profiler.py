"""The profiler: Chrome traces on the schedule, one per rank, with the Trainer's phases as named ranges."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tiny_models import Regressor
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric
from fabric.trainer import Trainer
from fabric.trainer.profiler import Profiler, cyclic_schedule

# Some tests profile without warmup steps to stay short; torch rightly warns users that this skews timings.
pytestmark = pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")


SCRIPT = Path(__file__).parents[1] / "scripts" / "trainer_profiler_ddp.py"


def _loader() -> DataLoader:
    x = torch.randn(24, 4, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)


def _spans(path: Path) -> list[dict[str, Any]]:
    """The complete ("X") events of a Chrome trace, with their names, start times and durations."""
    trace = json.loads(path.read_text())
    return [event for event in trace["traceEvents"] if event.get("ph") == "X"]


def _named(spans: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [span for span in spans if span["name"] == name]


def _inside(inner: dict[str, Any], outer: dict[str, Any]) -> bool:
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1


def test_trainer_writes_one_trace_per_active_cycle_with_its_phases_as_ranges(tmp_path: Path) -> None:
    profiler = Profiler(
        cyclic_schedule(skip_first=1, wait=1, warmup=1, active=2, repeat=1),
        torch_prof_folder=str(tmp_path / "{run_name}" / "torch_traces"),
    )
    model = Regressor(mae_in_training=True)
    trainer = Trainer(
        model=model,
        train_dataloader=_loader(),
        eval_dataloader=_loader(),
        eval_interval="3ba",
        max_duration="6ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        device_train_microbatch_size=2,
        profiler=profiler,
        run_name="profiled",
        progress_bar=False,
        accelerator="cpu",
        seed=0,
    )
    trainer.fit()

    # batches 0 skipped, 1 waited, 2 warmed up, 3 and 4 recorded; written after batch 5 (index 4) ended
    trace = tmp_path / "profiled" / "torch_traces" / "rank0.5.pt.trace.json"
    assert profiler.traces == [trace]
    assert sorted(path.name for path in trace.parent.iterdir()) == [trace.name]
    spans = _spans(trace)
    batches = _named(spans, "trainer/batch")
    assert len(batches) == 2
    assert len(_named(spans, "trainer/dataloader")) == 2
    assert len(_named(spans, "trainer/train_batch")) == 2 and len(_named(spans, "trainer/optimizer_step")) == 2
    for phase in ("trainer/forward", "trainer/loss", "trainer/backward"):
        assert len(_named(spans, phase)) == 4, phase  # two microbatches per batch
        assert all(any(_inside(span, batch) for batch in batches) for span in _named(spans, phase))
    # the eval after batch 3 (every 3 batches) ran inside the recorded window: 6 eval batches
    assert len(_named(spans, "trainer/eval")) == 1
    assert len(_named(spans, "trainer/eval_forward")) == 6
    # PyTorch's own operators are there too, inside the ranges
    forwards = _named(spans, "trainer/forward") + _named(spans, "trainer/eval_forward")
    linear = _named(spans, "aten::linear")
    assert len(linear) == 10 and all(any(_inside(op, forward) for forward in forwards) for op in linear)


def test_repeated_cycles_and_fit_calls_write_one_trace_each(tmp_path: Path) -> None:
    model = Regressor(mae_in_training=True)
    profiler = Profiler(
        cyclic_schedule(warmup=0, active=1, repeat=2),
        torch_prof_folder=str(tmp_path),
        torch_prof_filename="r{rank}-{batch}.json",
    )
    trainer = Trainer(
        model=model,
        train_dataloader=_loader(),
        max_duration="3ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        profiler=profiler,
        progress_bar=False,
        accelerator="cpu",
    )
    trainer.fit()
    trainer.fit(duration="3ba")  # the schedule starts again with each fit()
    assert [path.name for path in profiler.traces] == ["r0-1.json", "r0-2.json", "r0-4.json", "r0-5.json"]
    for path in profiler.traces:
        assert len(_named(_spans(path), "trainer/batch")) == 1


def test_fabric_profiler_for_a_custom_loop(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu")
    model = fabric.setup(nn.Linear(4, 1))
    with fabric.profiler(tmp_path, wait=1, warmup=1, active=2, repeat=2) as profiler:
        for x, y in _loader():
            with profiler.range("my_forward"):
                loss = F.mse_loss(model(x), y)
            loss.backward()
            profiler.step()
    # 6 steps: cycle 1 records steps 2-3, cycle 2 would record 6-7 but the loop ends after step 5
    assert [path.name for path in profiler.traces] == ["rank0.4.pt.trace.json"]
    assert len(_named(_spans(profiler.traces[0]), "my_forward")) == 2


def test_stopping_mid_cycle_writes_what_was_recorded(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu")
    with fabric.profiler(tmp_path, warmup=0, active=5) as profiler:
        for _ in range(3):
            with profiler.range("work"):
                torch.ones(3).sum()
            profiler.step()
    (trace,) = profiler.traces
    assert len(_named(_spans(trace), "work")) == 3


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"active": 0}, "active=0 must be a whole number of batches, at least 1"),
        ({"wait": -1}, "wait=-1 must be a whole number of batches, at least 0"),
        ({"warmup": 1.5}, r"warmup=1.5 must be a whole number"),
    ],
)
def test_bad_schedules_fail_when_made(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cyclic_schedule(**options)


def test_bad_file_names_fail_when_made() -> None:
    with pytest.raises(ValueError, match=r"may use only \{rank\} and \{batch\}"):
        Profiler(torch_prof_filename="{epoch}.json")
    with pytest.raises(ValueError, match="without folders"):
        Profiler(torch_prof_filename="a/b.json")
    with pytest.raises(ValueError, match=r"may use only \{run_name\}"):
        Profiler(torch_prof_folder="{rank}/traces")
    with pytest.raises(TypeError, match=r"must be a fabric\.trainer\.profiler\.Profiler"):
        Trainer(model=Regressor(), profiler="yes", progress_bar=False, accelerator="cpu")  # type: ignore[arg-type]


def test_every_rank_writes_its_own_trace(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    folder = str(tmp_path / "{run_name}")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), folder, "2"], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    traces = sorted((tmp_path / "profiled").iterdir())
    assert [path.name for path in traces] == ["rank0.4.pt.trace.json", "rank1.4.pt.trace.json"]
    pids = set()
    for trace in traces:
        spans = _spans(trace)
        assert len(_named(spans, "trainer/batch")) == 2
        assert len(_named(spans, "trainer/backward")) == 2
        pids |= {span["pid"] for span in _named(spans, "trainer/batch")}
    assert len(pids) == 2  # two processes, one trace each


def test_a_fit_that_fails_while_recording_keeps_its_trace_and_the_next_fit_profiles_again(tmp_path: Path) -> None:
    class FailsOnce(Regressor):
        calls = 0

        def forward(self, batch: Any) -> torch.Tensor:
            FailsOnce.calls += 1
            if FailsOnce.calls == 3:
                raise RuntimeError("the third batch fails")
            return super().forward(batch)

    model = FailsOnce()
    profiler = Profiler(cyclic_schedule(warmup=0, active=3), torch_prof_folder=str(tmp_path))
    trainer = Trainer(
        model=model,
        train_dataloader=_loader(),
        max_duration="4ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        profiler=profiler,
        progress_bar=False,
        accelerator="cpu",
    )
    with pytest.raises(RuntimeError, match="the third batch fails"):
        trainer.fit()
    trainer.fit()  # stops the failed fit's profiler (writing what it recorded), then profiles anew
    first, second = profiler.traces
    # two finished batches and the one that failed (its range closed when the profiler stopped)
    assert (first.name, len(_named(_spans(first), "trainer/batch"))) == ("rank0.2.pt.trace.json", 3)
    assert len(_named(_spans(first), "trainer/backward")) == 2
    assert second.name == "rank0.4.pt.trace.json"


def _trainer_with(profiler: Profiler) -> Trainer:
    model = Regressor()
    return Trainer(
        model=model,
        train_dataloader=_loader(),
        max_duration="1ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
        profiler=profiler,
        progress_bar=False,
        accelerator="cpu",
    )


def test_a_json_trace_handler_writes_the_trainers_phases_and_torch_writes_its_memory_timeline(tmp_path: Path) -> None:
    """Composer's profiling tutorial: trace_handlers=[JSONTraceHandler(...)], torch_prof_memory_filename= and
    torch_prof_overwrite= were TypeErrors."""
    from fabric.trainer.trace_handlers import JSONTraceHandler

    handler = JSONTraceHandler(folder=str(tmp_path / "traces"))
    profiler = Profiler(
        cyclic_schedule(skip_first=1, warmup=1, active=2),
        trace_handlers=[handler],
        torch_prof_folder=str(tmp_path / "torch"),
        torch_prof_memory_filename="rank{rank}.{batch}.memory.json",
        torch_prof_profile_memory=True,
        torch_prof_record_shapes=True,
        torch_prof_with_stack=True,
    )
    _trainer_with(profiler).fit()  # 6 batches: batch 1 skipped, 2 warms up, 3 and 4 are recorded
    assert handler.traces == [tmp_path / "traces" / "ep0-ba4-rank0.json", tmp_path / "traces" / "merged_trace.json"]
    events = json.loads(handler.traces[0].read_text())["traceEvents"]
    for name in ("trainer/batch", "trainer/forward", "trainer/backward", "trainer/optimizer_step"):
        phases = [event["ph"] for event in events if event["name"] == name]
        assert phases == ["B", "E", "B", "E"], name  # each of the 2 recorded batches opened and closed it once
    times = [event["ts"] for event in events]
    assert times == sorted(times)
    assert json.loads(handler.traces[1].read_text())["traceEvents"] == events  # one rank: the merge is its cycle
    memory = tmp_path / "torch" / "rank0.4.memory.json"
    assert memory in profiler.traces and isinstance(json.loads(memory.read_text()), list)

    with pytest.raises(FileExistsError, match=r"already holds traces; .* torch_prof_overwrite=True"):
        _trainer_with(Profiler(torch_prof_folder=str(tmp_path / "torch"))).fit()
    again = Profiler(
        cyclic_schedule(warmup=0, active=1), torch_prof_folder=str(tmp_path / "torch"), torch_prof_overwrite=True
    )
    _trainer_with(again).fit()
    assert again.traces == [tmp_path / "torch" / "rank0.1.pt.trace.json"]


def test_trace_options_that_cannot_work_fail_when_made() -> None:
    from fabric.trainer.trace_handlers import JSONTraceHandler

    with pytest.raises(ValueError, match=r"memory timeline .* needs record_shapes=True, with_stack=True"):
        Profiler(torch_prof_memory_filename="memory.json", torch_prof_profile_memory=True)
    html_needs_matplotlib = pytest.raises(ImportError, match=r"needs matplotlib .* a \.json or \.json\.gz name")
    with html_needs_matplotlib if importlib.util.find_spec("matplotlib") is None else contextlib.nullcontext():
        Profiler(
            torch_prof_memory_filename="memory.html",
            torch_prof_profile_memory=True,
            torch_prof_record_shapes=True,
            torch_prof_with_stack=True,
        )
    with pytest.raises(TypeError, match=r"trace_handlers take TraceHandler objects"):
        Profiler(trace_handlers=["json"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"filename='\{step\}.json' may use only"):
        JSONTraceHandler(filename="{step}.json")
