"""Microbatches: how batches split, and that weighted microbatch gradients equal the full-batch gradient."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fabric.trainer.microbatch import batch_size, loss_weight, split_batch, split_list

Pair = namedtuple("Pair", ["x", "y"])


@dataclass
class Batch:
    inputs: torch.Tensor
    name: str


def test_splits_every_container_along_the_first_dimension() -> None:
    batch = {"pair": Pair(torch.arange(5), torch.arange(5) * 10), "data": Batch(torch.ones(5, 2), "b"), "n": 3}
    pieces = split_batch(batch, 2)
    assert [batch_size(piece) for piece in pieces] == [2, 2, 1]
    assert pieces[2]["pair"].y.tolist() == [40]
    assert isinstance(pieces[0]["pair"], Pair) and isinstance(pieces[0]["data"], Batch)
    assert pieces[1]["data"].inputs.shape == (2, 2) and pieces[1]["data"].name == "b" and pieces[1]["n"] == 3


def test_bad_sizes_and_tensorless_batches_are_errors() -> None:
    with pytest.raises(ValueError, match="microbatch_size=0 must be at least 1"):
        split_batch(torch.ones(3), 0)
    with pytest.raises(TypeError, match="holds no tensor"):
        batch_size({"a": 1})


@pytest.mark.parametrize("microbatch_size", [1, 3, 4, 7, 10])
def test_weighted_microbatch_gradients_equal_the_full_batch_gradient(microbatch_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    F.cross_entropy(model(x), y).backward()
    full = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for piece_x, piece_y in split_batch((x, y), microbatch_size):
        (F.cross_entropy(model(piece_x), piece_y) * loss_weight(piece_x, total_samples=10)).backward()
    for expected, parameter in zip(full, model.parameters(), strict=True):
        torch.testing.assert_close(parameter.grad, expected)


def test_a_list_of_one_plain_value_per_sample_is_split_with_the_samples() -> None:
    """llm-foundry's batches carry per-sample token counts as lists of 0-dim tensors; repeating them whole in every
    microbatch would count every sample's tokens in each (wrong weights with accumulate_train_batch_on_tokens)."""
    batch = {
        "input_ids": torch.arange(10).reshape(5, 2),
        "total_tokens": [torch.tensor(n) for n in (2, 2, 1, 2, 2)],
        "names": ["a", "b", "c", "d", "e"],
        "config": ["x", "y"],  # not one per sample: repeated
    }
    pieces = split_batch(batch, 2)
    assert [[int(t) for t in piece["total_tokens"]] for piece in pieces] == [[2, 2], [1, 2], [2]]
    assert [piece["names"] for piece in pieces] == [["a", "b"], ["c", "d"], ["e"]]
    assert all(piece["config"] == ["x", "y"] for piece in pieces)


def test_split_list_chunks_per_sample_values_as_composers_split_list() -> None:
    """llm-foundry's in-context learning datasets split their per-sample lists (choices, answers) with Composer's
    ``_split_list`` when an evaluator has eval microbatches; the drop-in mode answers it with this."""
    assert split_list(["a", "b", "c", "d", "e"], 2) == [["a", "b"], ["c", "d"], ["e"]]
    assert split_list([[1, 2], [3]], 4) == [[[1, 2], [3]]]
    assert split_list([], 3) == []
    with pytest.raises(ValueError, match="microbatch_size=0 must be at least 1"):
        split_list(["a"], 0)
