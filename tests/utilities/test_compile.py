"""torch.compile and fabric.setup: a compiled module is taken apart and compiled again around the
strategy's wrapper, ``compile=`` compiles one that is not, and checkpoint keys carry no ``_orig_mod.``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.utilities import is_wrapped

SCRIPTS = Path(__file__).parents[1] / "scripts"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.layer(x))


class Counting:
    """A torch.compile backend that counts the graphs it is given and runs them as they are."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
        self.graphs += 1
        return graph.forward


def test_a_compiled_module_runs_compiled_and_saves_without_the_orig_mod_prefix(tmp_path: Path) -> None:
    backend = Counting()
    net = Net()
    fabric = Fabric(accelerator="cpu")
    model, optimizer = fabric.setup(torch.compile(net, backend=backend), torch.optim.SGD(net.parameters(), lr=0.1))
    assert model.module is net and is_wrapped(model)
    x = torch.randn(3, 2)
    assert torch.equal(model(x), net(x))
    assert backend.graphs == 1
    assert list(model.state_dict()) == ["layer.weight", "layer.bias"]
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer})
    assert list(torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]) == ["layer.weight", "layer.bias"]
    fresh = fabric.setup(torch.compile(Net(), backend=backend))
    fabric.load(tmp_path / "ckpt.pt", {"model": fresh}, strict=False)
    assert torch.equal(fresh.module.layer.weight, net.layer.weight)


def test_compile_argument_compiles_with_the_given_arguments() -> None:
    backend = Counting()
    fabric = Fabric(accelerator="cpu")
    model = fabric.setup_module(Net(), compile={"backend": backend})
    model(torch.randn(3, 2))
    assert backend.graphs == 1
    assert isinstance(fabric.setup(Net(), compile=True)._forward_module, torch._dynamo.OptimizedModule)
    assert isinstance(fabric.setup(Net(), compile=False)._forward_module, Net)


def test_compile_argument_with_a_compiled_module_or_of_a_wrong_type_is_an_error() -> None:
    fabric = Fabric(accelerator="cpu")
    with pytest.raises(ValueError, match="already compiled; pass one or the other"):
        fabric.setup(torch.compile(Net(), backend="eager"), compile=True)
    with pytest.raises(TypeError, match=r"compile='yes' is not valid\. Accepted: True, False, or a dict"):
        fabric.setup(Net(), compile="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already set up"):
        fabric.setup(torch.compile(fabric.setup(Net()), backend="eager"))


def test_compiled_model_on_two_ddp_ranks_is_compiled_and_synchronised(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "compiled_ddp.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["graphs"] == 1  # the module's forward was compiled inside DDP's
        assert report["grad"] == 2.0  # the mean of 1.0 and 3.0
        assert report["keys"] == ["layer.weight"]
