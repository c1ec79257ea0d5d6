"""Methods other than ``forward`` (``model.training_step(batch)``): marked ones run through the strategy's
wrapper so gradients are synchronised, unmarked ones that would bypass it raise."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.utilities.module_calls import forward_redirected, parameter_calls_refused

SCRIPTS = Path(__file__).parents[1] / "scripts"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) * 10

    def training_step(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return self(x).sum() * scale

    def describe(self) -> str:
        return "net"


@pytest.mark.parametrize(
    "strategy",
    [
        "ddp",
        "fsdp",
        pytest.param(
            "deepspeed_stage_3",
            marks=pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed"),
        ),
    ],
)
def test_marked_methods_synchronise_gradients_and_unmarked_ones_raise_on_two_ranks(
    tmp_path: Path, strategy: str
) -> None:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "forward_methods.py"), str(tmp_path), strategy],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for report in ranks:
        # Inputs 2.0 and 4.0: unsynchronised the ranks would hold 2.0 and 4.0; the mean is 3.0.
        if strategy != "deepspeed_stage_3":
            assert report["grads"] == [3.0, 3.0]
        assert report["weights"] == pytest.approx([0.7, 0.4])  # SGD lr 0.1 on the mean gradient, twice
        assert "Net.training_step() ran the module outside" in report["unmarked_self"]
        assert "fabric.mark_forward_method(model, 'training_step')" in report["unmarked_self"]
        assert "Net.layer_step() ran submodule 'layer' (Linear)" in report["unmarked_submodule"]
        assert "mark_forward_method('layer_step')" in report["unmarked_submodule"]
        assert report["unmarked_parameterless_loss"] == 2.0  # a loss module without parameters runs unmarked
        assert report["forward_restored"] and report["forward_output"] == pytest.approx(0.4)


def test_on_one_device_unmarked_methods_run_as_they_are() -> None:
    model = Fabric(accelerator="cpu").setup(Net())
    x = torch.ones(1, 2)
    assert model.training_step(x) == model(x).sum()


def test_marked_method_takes_keyword_arguments_and_leaves_forward_as_it_was() -> None:
    fabric = Fabric(accelerator="cpu")
    net = Net()
    model = fabric.setup(net)
    fabric.mark_forward_method(model, "training_step")
    x = torch.ones(1, 2)
    assert model.training_step(x, scale=2.0) == 2 * net(x).sum()
    assert "forward" not in net.__dict__
    assert model.describe() == "net"


def test_marking_forward_or_an_un_set_up_module_is_an_error() -> None:
    fabric = Fabric(accelerator="cpu")
    model = fabric.setup(Net())
    with pytest.raises(ValueError, match="forward always runs through the strategy"):
        model.mark_forward_method("forward")
    with pytest.raises(TypeError, match=r"needs the module returned by fabric.setup\(\); got an un-set-up Net"):
        fabric.mark_forward_method(Net(), "training_step")  # type: ignore[arg-type]


def test_redirect_is_undone_when_the_wrapper_fails_before_forward() -> None:
    net = Net()

    def refuse(module: nn.Module, args: object) -> None:
        raise RuntimeError("wrapper failed")

    handle = net.register_forward_pre_hook(refuse)
    with pytest.raises(RuntimeError, match="wrapper failed"), forward_redirected(net, "training_step"):
        net(torch.ones(1, 2))
    handle.remove()
    assert "forward" not in net.__dict__
    assert net(torch.ones(1, 2)).shape == (1, 1)


def test_refusal_covers_this_module_only_and_ends_with_the_context() -> None:
    net, other = Net(), nn.Linear(2, 1)
    refused: list[nn.Module] = []

    def refuse(called: nn.Module) -> None:
        refused.append(called)
        raise RuntimeError("refused")

    with parameter_calls_refused(net, refuse):  # type: ignore[arg-type]
        other(torch.ones(1, 2))  # another model's parameters: not refused
        nn.ReLU()(torch.ones(1))
        with pytest.raises(RuntimeError, match="refused"):
            net.layer(torch.ones(1, 2))
        with pytest.raises(RuntimeError, match="refused"):
            net.forward(torch.ones(1, 2))  # the module's own forward, called directly
    assert refused == [net.layer, net]
    assert net(torch.ones(1, 2)).shape == (1, 1)
