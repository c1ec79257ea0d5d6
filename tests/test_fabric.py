"""The Fabric API on one CPU process: launch, collectives, callbacks, logging, seeding, init contexts."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.loggers import Logger


def test_single_process_properties() -> None:
    fabric = Fabric(accelerator="cpu")
    assert fabric.device == torch.device("cpu")
    assert (fabric.global_rank, fabric.local_rank, fabric.node_rank, fabric.world_size) == (0, 0, 0, 1)
    assert fabric.is_global_zero
    assert "SingleDeviceStrategy" in repr(fabric)


def test_launch_runs_the_function_with_fabric_and_returns_its_result() -> None:
    fabric = Fabric(accelerator="cpu")
    assert fabric.launch(lambda f, x, y=0: (f is fabric, x + y), 2, y=3) == (True, 5)
    assert fabric.launch() is None  # idempotent


def test_all_gather_stacks_along_a_world_size_dimension() -> None:
    fabric = Fabric(accelerator="cpu")
    gathered = fabric.all_gather({"a": torch.ones(2, 3), "b": [torch.tensor(1.0), 5]})
    assert gathered["a"].shape == (1, 2, 3)
    assert gathered["b"][0].shape == (1,)
    assert gathered["b"][1].tolist() == [5]


def test_all_reduce_keeps_values_and_never_truncates_an_integer_mean() -> None:
    fabric = Fabric(accelerator="cpu")
    assert fabric.all_reduce(torch.tensor([1.5, 2.5]), reduce_op="sum").tolist() == [1.5, 2.5]
    mean = fabric.all_reduce(torch.tensor([3]), reduce_op="mean")
    assert mean.dtype == torch.float32
    assert fabric.all_reduce(7, reduce_op="max").item() == 7
    with pytest.raises(ValueError, match=r"reduce_op='avg' is not supported. Accepted values: \['mean', 'sum'"):
        fabric.all_reduce(torch.tensor(1.0), reduce_op="avg")  # type: ignore[arg-type]


def test_broadcast_barrier_and_rank_zero_first_are_single_process_no_ops() -> None:
    fabric = Fabric(accelerator="cpu")
    payload = {"x": [1, 2]}
    assert fabric.broadcast(payload) is payload
    fabric.barrier()
    ran = []
    with fabric.rank_zero_first():
        ran.append(True)
    assert ran == [True]


def test_print_only_on_local_rank_zero(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    fabric = Fabric(accelerator="cpu")
    fabric.print("hello")
    monkeypatch.setattr(type(fabric.strategy), "local_rank", property(lambda self: 1))
    fabric.print("hidden")
    assert capsys.readouterr().out == "hello\n"


class RecordingLogger(Logger):
    def __init__(self) -> None:
        self.records: list[tuple[dict[str, Any], int | None]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        self.records.append((dict(metrics), step))

    def log_hyperparams(self, params: Any) -> None:
        pass


def test_log_and_log_dict_reach_every_logger_with_plain_numbers() -> None:
    first, second = RecordingLogger(), RecordingLogger()
    fabric = Fabric(accelerator="cpu", loggers=[first, second])
    fabric.log("loss", torch.tensor(0.5), step=3)
    fabric.log_dict({"acc": 0.9, "lr": torch.tensor([0.1])}, step=4)
    expected = [({"loss": 0.5}, 3), ({"acc": 0.9, "lr": pytest.approx(0.1)}, 4)]
    assert first.records == second.records == expected
    assert fabric.logger is first and fabric.loggers == [first, second]


def test_logger_property_without_loggers_is_a_clear_error() -> None:
    with pytest.raises(AttributeError, match="has no logger"):
        _ = Fabric(accelerator="cpu").logger


def test_call_invokes_callbacks_that_define_the_hook_in_order() -> None:
    calls: list[tuple[str, int]] = []

    class First:
        def on_epoch_end(self, epoch: int) -> None:
            calls.append(("first", epoch))

    class Second:
        def on_epoch_end(self, epoch: int) -> None:
            calls.append(("second", epoch))

    fabric = Fabric(accelerator="cpu", callbacks=[First(), object(), Second()])
    fabric.call("on_epoch_end", epoch=2)
    fabric.call("hook_nobody_defines")
    assert calls == [("first", 2), ("second", 2)]


def test_seed_everything_makes_runs_repeatable() -> None:
    assert Fabric.seed_everything(123) == 123
    first = torch.randn(3)
    Fabric.seed_everything(123)
    assert torch.equal(first, torch.randn(3))
    with pytest.raises(ValueError, match="out of range"):
        Fabric.seed_everything(-1)


def test_seed_everything_says_the_seed_unless_told_not_to_as_lightnings(caplog: pytest.LogCaptureFixture) -> None:
    """Lightning's ``seed_everything(seed, workers, verbose=True)`` logs ``Seed set to N``; programs pass
    ``verbose=False`` (a TypeError here before)."""
    with caplog.at_level(logging.INFO, logger="fabric.utilities.seed"):
        Fabric.seed_everything(7)
        Fabric.seed_everything(8, verbose=False)
    assert [record.getMessage() for record in caplog.records] == ["Seed set to 7"]


def test_empty_init_skips_weight_initialisation() -> None:
    fabric = Fabric(accelerator="cpu")
    rng_before = torch.get_rng_state()
    with fabric.init_module(empty_init=True):
        nn.Linear(64, 64)
    assert torch.equal(rng_before, torch.get_rng_state())  # no random init ran
    with fabric.init_module(empty_init=False):
        nn.Linear(64, 64)
    assert not torch.equal(rng_before, torch.get_rng_state())


def test_clip_gradients_needs_exactly_one_threshold_and_clips_by_value() -> None:
    fabric = Fabric(accelerator="cpu")
    layer = nn.Linear(3, 1)
    model, optimizer = fabric.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    fabric.backward(model(torch.full((4, 3), 10.0)).sum())
    with pytest.raises(ValueError, match="exactly one of clip_val or max_norm"):
        fabric.clip_gradients(model, optimizer)
    with pytest.raises(ValueError, match="exactly one of clip_val or max_norm"):
        fabric.clip_gradients(model, optimizer, clip_val=1.0, max_norm=1.0)
    assert fabric.clip_gradients(model, optimizer, clip_val=0.25) is None
    assert all(p.grad.abs().max() <= 0.25 for p in layer.parameters())


def test_no_backward_sync_needs_a_set_up_module() -> None:
    fabric = Fabric(accelerator="cpu")
    with pytest.raises(TypeError, match=r"model = fabric.setup\(model\)"):
        fabric.no_backward_sync(nn.Linear(2, 2))  # type: ignore[arg-type]
    with fabric.no_backward_sync(fabric.setup(nn.Linear(2, 2))):
        pass


def test_to_device_moves_modules_and_collections() -> None:
    fabric = Fabric(accelerator="cpu")
    layer = nn.Linear(2, 2)
    assert fabric.to_device(layer) is layer
    moved = fabric.to_device({"x": torch.ones(1), "n": 3})
    assert moved["x"].device.type == "cpu" and moved["n"] == 3


def _run_python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()


#: What neither ``Fabric`` nor the Trainer imports until a run uses it: dynamo and the optional packages, and DCP with
#: DTensor (0.4 s, sympy among them), which only sharded strategies and sharded or Hugging Face checkpoints need.
LOADED_ON_USE = (
    "torch._dynamo",
    "deepspeed",
    "tensorboard",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
)


def test_import_fabric_is_lazy_and_never_loads_dynamo() -> None:
    assert _run_python("import sys, fabric; print('torch' in sys.modules)") == "False"
    code = (
        "import sys\nfrom fabric import Fabric\nfrom fabric.trainer import Trainer\nFabric(accelerator='cpu')\n"
        f"print(sorted(m for m in {LOADED_ON_USE!r} if m in sys.modules))"
    )
    assert _run_python(code) == "[]"


def test_sharded_model_is_init_module_under_lightnings_deprecated_name() -> None:
    fabric = Fabric(accelerator="cpu", precision="bf16-true")
    with pytest.warns(FutureWarning, match=r"fabric\.sharded_model\(\) is deprecated: use fabric\.init_module\(\)"):
        context = fabric.sharded_model()
    with context:
        layer = nn.Linear(2, 2)
    assert layer.weight.dtype == torch.bfloat16  # built as init_module builds it
