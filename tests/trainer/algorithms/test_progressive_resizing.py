"""ProgressiveResizing: image sizes follow the schedule; crops keep inputs and targets aligned."""

from __future__ import annotations

import pytest
import torch

from fabric.trainer.algorithms.progressive_resizing import ProgressiveResizing, resize_batch, resize_scale
from fabric.trainer.core.engine import Engine
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time, Timestamp


def test_scale_schedule_holds_grows_linearly_then_finetunes_at_full_size() -> None:
    assert resize_scale(0.3, initial_scale=0.5, delay_fraction=0.5, finetune_fraction=0.2) == 0.5
    assert resize_scale(0.5, initial_scale=0.5, delay_fraction=0.5, finetune_fraction=0.2) == 0.5
    assert resize_scale(0.65, initial_scale=0.5, delay_fraction=0.5, finetune_fraction=0.2) == pytest.approx(0.75)
    assert resize_scale(0.8, initial_scale=0.5, delay_fraction=0.5, finetune_fraction=0.2) == 1.0


@pytest.mark.parametrize(("batch", "side"), [(0, 16), (5, 16), (65, 24), (80, 32), (99, 32)])
def test_the_algorithm_resizes_inputs_to_the_scheduled_size(batch: int, side: int) -> None:
    state = State(model=torch.nn.Identity(), max_duration=Time.from_timestring("100ba"))
    state.timestamp = Timestamp(batch=batch)
    inputs, targets = torch.rand(2, 3, 32, 32), torch.arange(2)
    state.batch = (inputs, targets)
    Engine(state, None, [ProgressiveResizing(initial_scale=0.5, size_increment=8)]).run_event(Event.AFTER_DATALOADER)
    assert state.batch[0].shape == (2, 3, side, side) and state.batch[1] is targets
    if side == 32:
        assert state.batch[0] is inputs


def test_resizing_is_bilinear_and_targets_use_nearest() -> None:
    inputs = torch.arange(16.0).view(1, 1, 4, 4)
    masks = torch.arange(16).view(1, 4, 4)
    small, small_masks = resize_batch(inputs, masks, scale=0.5, size_increment=1)
    torch.testing.assert_close(small, torch.tensor([[[[2.5, 4.5], [10.5, 12.5]]]]))  # 2x2 block means
    assert small_masks is not None and small_masks.dtype == torch.int64
    assert set(small_masks.flatten().tolist()) <= set(range(16))  # class ids survive


def test_cropping_takes_the_same_window_from_inputs_and_targets() -> None:
    inputs = torch.arange(64.0).view(1, 1, 8, 8)
    targets = torch.arange(64).view(1, 8, 8)
    cropped, cropped_targets = resize_batch(
        inputs, targets, scale=0.5, mode="crop", size_increment=2, generator=torch.Generator().manual_seed(0)
    )
    assert cropped.shape == (1, 1, 4, 4) and cropped_targets is not None
    assert torch.equal(cropped[0, 0].long(), cropped_targets[0])
    top, left = divmod(int(cropped[0, 0, 0, 0]), 8)
    assert torch.equal(cropped[0, 0], inputs[0, 0, top : top + 4, left : left + 4])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"initial_scale": 0.0}, r"initial_scale=0.0 must be in \(0, 1\]"),
        ({"delay_fraction": 0.7, "finetune_fraction": 0.5}, "must be at most 1"),
        ({"size_increment": 0}, "size_increment=0"),
        ({"mode": "pad"}, "mode='pad' is not supported; use one of resize, crop"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ProgressiveResizing(**kwargs)  # type: ignore[arg-type]
