"""SelectiveBackprop keeps exactly round(keep * n) samples, the ones with the highest loss, in the stated window."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fabric.trainer.algorithms.selective_backprop import SelectiveBackprop, should_select
from fabric.trainer.core.engine import Engine
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time, Timestamp


class Scorer(nn.Module):
    """Outputs a fixed logit vector, so each sample's loss is set by its target alone; counts train-mode calls."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0]))
        self.train_mode_calls = 0

    def forward(self, batch: Any) -> torch.Tensor:
        self.train_mode_calls += int(self.training)
        return self.logits.expand(batch[0].shape[0], 5)

    def loss(self, outputs: torch.Tensor, batch: Any, reduction: str = "mean") -> torch.Tensor:
        return F.cross_entropy(outputs, batch[1], reduction=reduction)


def _select(algorithm: SelectiveBackprop, batch: Any, model: nn.Module | None = None, at_batch: int = 10) -> Any:
    state = State(model=model or Scorer(), max_duration=Time.from_timestring("20ba"))
    state.batch, state.timestamp = batch, Timestamp(batch=at_batch)
    Engine(state, None, [algorithm]).run_event(Event.AFTER_DATALOADER)
    return state.batch


@pytest.mark.parametrize(("keep", "kept"), [(0.5, 5), (0.3, 3), (0.25, 2), (1.0, 10)])
def test_keeps_exactly_the_highest_loss_samples_in_order(keep: float, kept: int) -> None:
    targets = torch.tensor([0, 4, 1, 3, 2, 4, 0, 3, 1, 2])  # loss grows with the target id
    inputs = torch.arange(10.0).view(10, 1)
    model = Scorer()
    selected = _select(SelectiveBackprop(start=0.0, end=1.0, keep=keep, interrupt=0), (inputs, targets), model)
    losses = F.cross_entropy(model.logits.expand(10, 5), targets, reduction="none")
    expected = losses.topk(kept).indices.sort().values
    assert len(selected[0]) == round(keep * 10) == kept
    assert torch.equal(selected[0].flatten(), expected.float()) and torch.equal(selected[1], targets[expected])
    assert model.training and model.train_mode_calls == 0  # scored in eval mode, mode restored


def test_a_loss_fn_and_mapping_batches_work() -> None:
    batch = {"x": torch.zeros(4, 1), "y": torch.tensor([0, 4, 2, 1]), "name": "kept as is"}
    algorithm = SelectiveBackprop(
        start=0.0, end=1.0, keep=0.5, interrupt=0, loss_fn=F.cross_entropy, input_key="x", target_key="y"
    )

    class MappingScorer(Scorer):
        def forward(self, batch: Any) -> torch.Tensor:
            return self.logits.expand(batch["x"].shape[0], 5)

    selected = _select(algorithm, batch, MappingScorer())
    assert selected["y"].tolist() == [4, 2] and selected["name"] == "kept as is"


def test_window_and_interrupt_decide_which_batches_are_selective() -> None:
    assert not should_select(0.4, 0, start=0.5, end=0.9, interrupt=2)
    assert not should_select(0.9, 0, start=0.5, end=0.9, interrupt=2)
    pattern = [should_select(0.6, index, start=0.5, end=0.9, interrupt=2) for index in range(6)]
    assert pattern == [True, False, True, False, True, False]  # as Composer: interrupt=2 alternates
    pattern = [should_select(0.6, index, start=0.5, end=0.9, interrupt=3) for index in range(6)]
    assert pattern == [True, True, False, True, True, False]  # every third batch trains in full
    assert all(should_select(0.6, index, start=0.5, end=0.9, interrupt=0) for index in range(6))
    batch = (torch.zeros(8, 1), torch.zeros(8, dtype=torch.long))
    assert len(_select(SelectiveBackprop(start=0.6, end=0.9), batch, at_batch=10)[0]) == 8  # 0.5 < start


def test_a_model_loss_without_reduction_is_rejected_at_init() -> None:
    class Plain(nn.Module):
        def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
            return outputs.mean()

    state = State(model=Plain(), max_duration=Time.from_timestring("20ba"))
    with pytest.raises(ValueError, match="accept reduction='none'"):
        Engine(state, None, [SelectiveBackprop()]).run_event(Event.INIT)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep": 0.0}, r"keep=0.0 must be in \(0, 1\]"),
        ({"keep": 1.5}, r"keep=1.5 must be in \(0, 1\]"),
        ({"start": 0.9, "end": 0.5}, "start=0.9 must be less than end=0.5"),
        ({"scale_factor": 2.0}, "scale_factor=2.0"),
        ({"interrupt": -1}, "interrupt=-1"),
        ({"loss_fn": lambda outputs, targets: outputs}, "loss_fn must accept reduction='none'"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SelectiveBackprop(**kwargs)
