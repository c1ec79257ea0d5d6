"""StochasticDepth: residual branches dropped at the stated rates in training, scaled in evaluation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType

import pytest
import torch
from torch import nn

from fabric.trainer.algorithms import StochasticDepth
from fabric.trainer.algorithms.stochastic_depth import DroppableBranch, apply_stochastic_depth
from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.engine import Engine
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time, Timestamp


class CountingBranch(nn.Module):
    """Adds 1 to its input and counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + 1


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.residual = CountingBranch()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.residual(x)


def _blocks(count: int) -> nn.Sequential:
    return nn.Sequential(*[Block() for _ in range(count)])


def test_a_branch_is_dropped_at_the_stated_rate_and_not_computed_when_dropped() -> None:
    torch.manual_seed(0)
    model = _blocks(1)
    branch = model[0].residual
    apply_stochastic_depth(model, Block, "residual", drop_rate=0.3, drop_distribution="uniform")
    x = torch.zeros(2, 3)
    outputs = [model(x) for _ in range(4000)]
    dropped = sum(bool(torch.equal(out, x)) for out in outputs)
    kept = sum(bool(torch.equal(out, x + 1)) for out in outputs)
    assert dropped + kept == 4000
    assert dropped / 4000 == pytest.approx(0.3, abs=0.025)  # 3.5 standard deviations
    assert kept <= branch.calls <= kept + 1  # a dropped call computes the branch only to learn its output shape


def test_in_eval_the_branch_is_scaled_by_its_survival_probability_deterministically() -> None:
    model = _blocks(1)
    apply_stochastic_depth(model, Block, "residual", drop_rate=0.25, drop_distribution="uniform")
    model.eval()
    x = torch.full((2, 3), 3.0)
    outputs = [model(x) for _ in range(50)]
    assert all(torch.equal(out, torch.full((2, 3), 3.0 + 0.75 * 4.0)) for out in outputs)


def test_linear_distribution_grows_the_rate_with_depth() -> None:
    wrappers = apply_stochastic_depth(_blocks(4), "Block", "residual", drop_rate=0.2)
    assert [w.drop_rate for w in wrappers] == pytest.approx([0.05, 0.1, 0.15, 0.2])
    wrappers = apply_stochastic_depth(_blocks(3), Block, "residual", drop_rate=0.2, drop_distribution="uniform")
    assert [w.drop_rate for w in wrappers] == pytest.approx([0.2, 0.2, 0.2])


def test_a_branch_that_changes_the_shape_is_replaced_by_zeros_of_its_output_shape(image_task: ModuleType) -> None:
    block = image_task.ResidualBlock(4, 8, stride=2)
    apply_stochastic_depth(nn.Sequential(block), image_task.ResidualBlock, "branch", 1.0, "uniform")
    images = torch.randn(2, 4, 6, 6)
    torch.testing.assert_close(block(images), torch.relu(block.shortcut(images)))


@pytest.mark.parametrize(("warmup", "batch", "share"), [("0.5dur", 2, 0.4), ("4ba", 1, 0.25), ("4ba", 6, 1.0)])
def test_warmup_ramps_the_rates_linearly(warmup: str, batch: int, share: float) -> None:
    model = _blocks(2)
    algorithm = StochasticDepth(Block, "residual", drop_rate=0.4, drop_distribution="uniform", drop_warmup=warmup)
    state = State(model=model, max_duration=Time.from_timestring("10ba"))
    engine = Engine(state, None, [algorithm])
    engine.run_event(Event.INIT)
    assert [branch.drop_rate for branch in algorithm.branches] == [0.0, 0.0]
    state.timestamp = Timestamp(batch=batch)
    engine.run_event(Event.BATCH_START)
    assert [branch.drop_rate for branch in algorithm.branches] == pytest.approx([0.4 * share] * 2)


def test_without_warmup_the_algorithm_acts_only_at_init() -> None:
    algorithm = StochasticDepth(Block, "residual")
    state = State(model=_blocks(1), max_duration=Time.from_timestring("10ba"))
    assert algorithm.match(Event.INIT, state) and not algorithm.match(Event.BATCH_START, state)
    algorithm.apply(Event.INIT, state, None)
    assert isinstance(state.model[0].residual, DroppableBranch)


def test_naming_a_class_the_model_lacks_or_a_missing_branch_fails_with_what_exists() -> None:
    with pytest.raises(ValueError, match=r"found no 'Bottleneck' block in the model; its module classes are \["):
        apply_stochastic_depth(_blocks(1), "Bottleneck", "residual")
    with pytest.raises(ValueError, match=r"Block has no submodule 'branch' .* its submodules are \['residual'\]"):
        apply_stochastic_depth(_blocks(1), Block, "branch")


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"drop_rate": 1.5}, "drop_rate must be a probability in \\[0, 1\\], got 1.5"),
        ({"drop_distribution": "cubic"}, "drop_distribution must be one of \\('linear', 'uniform'\\), got 'cubic'"),
        ({"target_layer": 3}, "target_layer must be an nn.Module subclass or its name, got 3"),
        ({"branch_attribute": "a.b"}, "branch_attribute must be an attribute name, got 'a.b'"),
        ({"drop_warmup": "ten"}, "Time string 'ten' is not valid"),
    ],
)
def test_bad_arguments_fail_at_construction(arguments: dict[str, object], message: str) -> None:
    kwargs: dict[str, object] = {"target_layer": Block, "branch_attribute": "residual", **arguments}
    with pytest.raises(ValueError, match=message):
        StochasticDepth(**kwargs)  # type: ignore[arg-type]


def test_a_model_still_learns_with_stochastic_depth(
    image_task: ModuleType, accuracy_after_training: Callable[[Sequence[Algorithm]], float]
) -> None:
    assert accuracy_after_training([StochasticDepth(image_task.ResidualBlock, "branch", drop_rate=0.2)]) > 0.6
