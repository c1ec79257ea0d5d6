"""Batch helpers: parts read and replaced by int index or str key, without changing the caller's batch."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from fabric.trainer.algorithms.batch import check_batch_key, get_batch_item, index_batch, set_batch_item

Pair = namedtuple("Pair", ["inputs", "targets"])


@pytest.mark.parametrize(
    "batch", [(torch.zeros(2), torch.ones(2)), [torch.zeros(2), torch.ones(2)], Pair(torch.zeros(2), torch.ones(2))]
)
def test_sequences_are_copied_with_the_same_type(batch: object) -> None:
    new = set_batch_item(batch, 1, "replaced")
    assert type(new) is type(batch) and new[1] == "replaced"  # type: ignore[index]
    assert torch.equal(get_batch_item(batch, 1), torch.ones(2))  # the original is untouched


def test_mappings_by_key() -> None:
    batch = {"image": torch.zeros(2), "label": torch.ones(2)}
    new = set_batch_item(batch, "label", 5)
    assert new == {"image": batch["image"], "label": 5} and torch.equal(batch["label"], torch.ones(2))


def test_missing_parts_and_bad_keys_are_clear_errors() -> None:
    with pytest.raises(KeyError, match=r"no key 'target'; its keys are \['image', 'label'\]"):
        get_batch_item({"image": 0, "label": 1}, "target")
    with pytest.raises(IndexError, match="Key 2 does not index a batch of 2 parts"):
        set_batch_item((0, 1), 2, "x")
    with pytest.raises(TypeError, match="input_key=None must be an int index"):
        check_batch_key("input_key", None)


def test_index_batch_selects_samples_in_every_tensor_with_the_batch_dimension() -> None:
    batch = {"x": torch.arange(5), "pair": (torch.arange(10).view(5, 2), "tag"), "per_batch": torch.tensor(3.0)}
    picked = index_batch(batch, torch.tensor([4, 1]))
    assert picked["x"].tolist() == [4, 1] and picked["pair"][0].tolist() == [[8, 9], [2, 3]]
    assert picked["pair"][1] == "tag" and picked["per_batch"] is batch["per_batch"]
