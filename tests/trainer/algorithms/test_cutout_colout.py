"""CutOut zeroes exactly its holes; ColOut keeps exactly the stated share of rows and columns, in order."""

from __future__ import annotations

import pytest
import torch

from fabric.trainer.algorithms.colout import ColOut, colout_batch
from fabric.trainer.algorithms.cutout import CutOut, cutout_batch
from fabric.trainer.core.engine import Engine
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time


def _box_sides(zeroed: torch.Tensor) -> tuple[int, int]:
    """Height and width of the zeroed region, asserting it is one filled rectangle."""
    rows, cols = zeroed.nonzero(as_tuple=True)
    height, width = int(rows.max() - rows.min() + 1), int(cols.max() - cols.min() + 1)
    assert height * width == int(zeroed.sum()), "the zeroed pixels do not form one rectangle"
    return height, width


@pytest.mark.parametrize(("length", "side"), [(0.5, 6), (3, 3)])
def test_cutout_zeroes_exactly_one_square_per_sample(length: float, side: int) -> None:
    inputs = torch.rand(16, 3, 12, 14) + 1.0  # never zero on its own
    holed = cutout_batch(inputs, num_holes=1, length=length, generator=torch.Generator().manual_seed(0))
    for sample in range(16):
        zeroed = holed[sample] == 0
        assert torch.equal(zeroed[0], zeroed[1]) and torch.equal(zeroed[0], zeroed[2])  # every channel alike
        height, width = _box_sides(zeroed[0])
        rows, cols = zeroed[0].nonzero(as_tuple=True)
        # A side is shorter than `side` only where the square was clipped at the image border.
        assert height == side or rows.min() == 0 or rows.max() == 11
        assert width == side or cols.min() == 0 or cols.max() == 13
        assert torch.equal(holed[sample][~zeroed], inputs[sample][~zeroed])


def test_cutout_num_holes_bounds_the_zeroed_area() -> None:
    inputs = torch.ones(32, 1, 20, 20)
    holed = cutout_batch(inputs, num_holes=3, length=4, generator=torch.Generator().manual_seed(0))
    zeroed = (holed == 0).flatten(1).sum(dim=1)
    assert int(zeroed.max()) <= 3 * 16 and int(zeroed.min()) >= 1


def test_cutout_algorithm_fires_after_the_dataloader_on_the_inputs_only() -> None:
    inputs, targets = torch.ones(4, 1, 8, 8), torch.arange(4)
    state = State(model=torch.nn.Identity(), max_duration=Time.from_timestring("1ba"))
    state.batch = [inputs, targets]
    Engine(state, None, [CutOut(num_holes=1, length=4)]).run_event(Event.AFTER_DATALOADER)
    assert isinstance(state.batch, list) and state.batch[1] is targets
    assert ((state.batch[0] == 0).flatten(1).sum(dim=1) > 0).all()


def _coordinates(samples: int, height: int, width: int) -> torch.Tensor:
    """Pixel values that encode their own (row, column): value = row * 100 + column."""
    grid = torch.arange(height).view(-1, 1) * 100 + torch.arange(width).view(1, -1)
    return grid.float().expand(samples, 2, height, width).clone()


@pytest.mark.parametrize("per_batch", [True, False])
def test_colout_keeps_the_stated_share_of_rows_and_columns_in_order(per_batch: bool) -> None:
    inputs = _coordinates(5, 20, 10)
    kept = colout_batch(inputs, p_row=0.25, p_col=0.4, batch=per_batch, generator=torch.Generator().manual_seed(0))
    assert kept.shape == (5, 2, 15, 6)  # round(0.75 * 20) rows, round(0.6 * 10) columns
    rows, cols = kept[:, 0, :, 0] // 100, kept[:, 0, 0, :] % 100
    for sample in range(5):
        assert rows[sample].tolist() == sorted(set(rows[sample].tolist()))  # distinct, original order
        assert cols[sample].tolist() == sorted(set(cols[sample].tolist()))
        expected = rows[sample].view(-1, 1) * 100 + cols[sample].view(1, -1)
        assert torch.equal(kept[sample, 1], expected)  # every kept pixel is the (row, col) it claims
    same_everywhere = bool((rows == rows[0]).all() and (cols == cols[0]).all())
    assert same_everywhere == per_batch


def test_colout_algorithm_shrinks_the_batch_inputs() -> None:
    state = State(model=torch.nn.Identity(), max_duration=Time.from_timestring("1ba"))
    state.batch = {"image": torch.rand(3, 1, 10, 10), "label": torch.arange(3)}
    Engine(state, None, [ColOut(p_row=0.2, p_col=0.5, input_key="image")]).run_event(Event.AFTER_DATALOADER)
    assert state.batch["image"].shape == (3, 1, 8, 5)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: CutOut(num_holes=0), "num_holes=0"),
        (lambda: CutOut(length=0), "length=0"),
        (lambda: CutOut(length=2.5), "length=2.5"),
        (lambda: ColOut(p_row=1.0), r"p_row=1.0 must be a fraction in \[0, 1\)"),
        (lambda: ColOut(p_col=-0.1), "p_col=-0.1"),
    ],
)
def test_bad_arguments_fail_at_construction(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]
