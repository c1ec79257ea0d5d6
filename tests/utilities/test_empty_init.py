"""``fabric.init_module(empty_init=True)`` on one device and under DDP: a module left uninitialised refuses
to run until a load filled it, instead of training on arbitrary memory."""

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
from fabric.utilities.exceptions import CheckpointError

SCRIPTS = Path(__file__).parents[1] / "scripts"


class Net(nn.Module):
    def __init__(self, out_features: int = 1) -> None:
        super().__init__()
        self.body = nn.Linear(6, 16)
        self.embedding = nn.Embedding(4, 6, padding_idx=0)  # its reset also zeroes a row in place
        self.head = nn.Linear(16, out_features)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.head(torch.tanh(self.body(self.embedding(tokens))))
        return output


TOKENS = torch.tensor([[1, 2, 3, 0]])


def _empty(fabric: Fabric) -> Net:
    with fabric.init_module(empty_init=True):
        return Net()


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, Net]:
    """A normally initialised model and the file ``fabric.save`` wrote it to."""
    torch.manual_seed(0)
    source = Net()
    Fabric(accelerator="cpu", devices=1).save(tmp_path / "source.pt", {"model": source})
    return tmp_path / "source.pt", source


def test_a_forward_before_a_load_is_refused_naming_the_module_tensors_and_ways_out() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    model = fabric.setup(_empty(fabric))
    with pytest.raises(RuntimeError) as error:
        model(TOKENS)
    message = str(error.value)
    assert message.startswith("Net was built with fabric.init_module(empty_init=True) and 5 of its tensors")
    assert "(body.weight, body.bias, embedding.weight, head.weight, head.bias)" in message
    assert "fabric.load() or fabric.load_raw()" in message and "without empty_init=True" in message


def test_fabric_load_lifts_the_guard_and_the_model_computes_what_the_checkpoint_holds(
    checkpoint: tuple[Path, Net],
) -> None:
    path, source = checkpoint
    fabric = Fabric(accelerator="cpu", devices=1)
    model = fabric.setup(_empty(fabric))
    fabric.load(path, {"model": model})
    assert torch.equal(model(TOKENS), source(TOKENS))


def test_a_failed_load_keeps_the_guard(checkpoint: tuple[Path, Net]) -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    with fabric.init_module(empty_init=True):
        wide = Net(out_features=2)
    model = fabric.setup(wide)
    with pytest.raises(CheckpointError):
        fabric.load(checkpoint[0], {"model": model})
    with pytest.raises(RuntimeError, match="empty_init=True"):
        model(TOKENS)


@pytest.mark.parametrize("how", ["load_raw before setup", "load_raw after setup", "load_state_dict before setup"])
def test_other_ways_of_filling_the_weights_count_as_a_load(tmp_path: Path, how: str) -> None:
    torch.manual_seed(0)
    source = Net()
    torch.save(source.state_dict(), tmp_path / "weights.pt")
    fabric = Fabric(accelerator="cpu", devices=1)
    model = _empty(fabric)
    if how == "load_raw before setup":
        fabric.load_raw(tmp_path / "weights.pt", model)
    elif how == "load_state_dict before setup":  # plain torch: the tensors were written, so they count as filled
        model.load_state_dict(source.state_dict())
    wrapped = fabric.setup(model)
    if how == "load_raw after setup":
        fabric.load_raw(tmp_path / "weights.pt", wrapped)
    assert torch.equal(wrapped(TOKENS), source(TOKENS))


def test_state_dict_loading_into_the_set_up_module_lifts_the_guard() -> None:
    torch.manual_seed(0)
    source = Net()
    fabric = Fabric(accelerator="cpu", devices=1)
    model = fabric.setup(_empty(fabric))
    model.load_state_dict(source.state_dict())
    assert torch.equal(model(TOKENS), source(TOKENS))


@pytest.mark.parametrize("how", ["fabric.load_raw", "load_state_dict"])
def test_a_module_built_under_inference_mode_is_guarded_until_loaded(checkpoint: tuple[Path, Net], how: str) -> None:
    """litgpt's ``generate`` runs its whole ``main`` under ``torch.inference_mode()``: inference tensors have no
    version counter, so they count as uninitialised until a load into the module."""
    path, source = checkpoint
    fabric = Fabric(accelerator="cpu", devices=1)
    with torch.inference_mode():
        model = fabric.setup(_empty(fabric))
        with pytest.raises(RuntimeError, match=r"Net was built with fabric\.init_module"):
            model(TOKENS)
        if how == "fabric.load_raw":
            torch.save(source.state_dict(), path.with_name("raw.pt"))
            fabric.load_raw(path.with_name("raw.pt"), model)
        else:
            model.load_state_dict(source.state_dict())
        assert torch.equal(model(TOKENS), source(TOKENS))


def test_a_plain_load_before_setup_under_inference_mode_fills_what_it_loads_and_nothing_else() -> None:
    """litgpt's ``chat``: built and loaded with a plain ``load_state_dict`` under ``torch.inference_mode()``, then set
    up. The tensors the state dict filled count as loaded (an inference tensor has no version counter to tell it);
    those it left out are still guarded."""
    torch.manual_seed(0)
    source = Net()
    fabric = Fabric(accelerator="cpu", devices=1)
    with torch.inference_mode():
        loaded = _empty(fabric)
        loaded.load_state_dict(source.state_dict())
        assert torch.equal(fabric.setup(loaded)(TOKENS), source(TOKENS))
        partly = _empty(fabric)
        partly.load_state_dict({k: v for k, v in source.state_dict().items() if not k.startswith("head")}, strict=False)
        with pytest.raises(RuntimeError, match=r"2 of its tensors \(head\.weight, head\.bias\)"):
            fabric.setup(partly)(TOKENS)


def test_only_tensors_whose_initialisation_was_skipped_are_guarded() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    with fabric.init_module(empty_init=True):
        scale = nn.Sequential(nn.Tanh())
        scale.register_parameter("factor", nn.Parameter(torch.ones(3)))  # no torch.nn.init call to skip
    assert torch.equal(fabric.setup(scale)(torch.zeros(3)), torch.zeros(3))
    with fabric.init_module(empty_init=False):
        initialised = Net()
    fabric.setup(initialised)(TOKENS)  # built without empty_init: nothing to guard


def test_under_ddp_the_forward_is_refused_until_fabric_load_then_trains_like_the_source(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "empty_init_guard.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for report in reports:
        assert report["world_size"] == 2
        assert report["refused"].startswith("Sequential was built with fabric.init_module(empty_init=True)")
        assert "(0.weight, 0.bias, 2.weight, 2.bias)" in report["refused"]
        assert report["loss"] == report["source_loss"] and torch.isfinite(torch.tensor(report["loss"]))
        assert report["params_equal_source"]
    assert reports[0]["params"] == reports[1]["params"]


def test_an_init_context_that_fails_to_enter_or_is_never_entered_leaves_no_mode_on() -> None:
    """``fabric.init_module()`` entered ``torch.device`` (a global torch function mode) when it was called: a precision
    refusing the block, or a call never used in ``with``, left the mode on for the rest of the process (found when it
    turned off the fused path of every later ``nn.TransformerEncoderLayer``)."""
    from contextlib import AbstractContextManager
    from typing import Any

    from torch.overrides import _get_current_function_mode_stack
    from typing_extensions import override

    from fabric.plugins.precision.precision import Precision

    class Refusing(Precision):
        @override
        def module_init_context(self) -> AbstractContextManager[Any]:
            raise ValueError("this precision refuses init_module()")

    fabric = Fabric(accelerator="cpu", plugins=Refusing())
    fabric.init_module(empty_init=True)  # made, never entered
    fabric.init_tensor()
    assert _get_current_function_mode_stack() == []
    with pytest.raises(ValueError, match="this precision refuses"), fabric.init_module(empty_init=True):
        pass
    assert _get_current_function_mode_stack() == []
    with Fabric(accelerator="cpu").init_module(empty_init=True):
        assert len(_get_current_function_mode_stack()) == 2  # skipped initialisation, the device
    assert _get_current_function_mode_stack() == []
