"""SeqLengthWarmup: the sequence length follows the linear schedule; every token tensor is cut or reshaped alike."""

from __future__ import annotations

import pytest
import torch

from fabric.trainer.algorithms.seq_length_warmup import SeqLengthWarmup, set_batch_sequence_length, warmup_length
from fabric.trainer.core.engine import Engine
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time, Timestamp


def _batch() -> dict[str, object]:
    ids = torch.arange(4 * 64).view(4, 64)
    return {"input_ids": ids, "attention_mask": torch.ones(4, 64), "labels": ids + 1, "ids": torch.arange(4), "n": 4}


@pytest.mark.parametrize(
    ("batch", "length"),
    [(0, 8), (10, 8 + 8 * int(56 * 10 / 30 / 8)), (15, 32), (29, 8 * int((8 + 56 * 29 / 30) / 8)), (30, 64), (99, 64)],
)
def test_lengths_follow_the_schedule(batch: int, length: int) -> None:
    state = State(model=torch.nn.Identity(), max_duration=Time.from_timestring("100ba"))
    state.timestamp, state.batch = Timestamp(batch=batch), _batch()
    warmup = SeqLengthWarmup(duration=0.3, min_seq_length=8, max_seq_length=64, step_size=8)
    Engine(state, None, [warmup]).run_event(Event.AFTER_DATALOADER)
    assert state.batch["input_ids"].shape == (4, length)
    assert state.batch["attention_mask"].shape == state.batch["labels"].shape == (4, length)
    assert torch.equal(state.batch["labels"], state.batch["input_ids"] + 1)
    assert state.batch["n"] == 4 and state.batch["ids"].shape == (4,)


def test_warmup_length_is_a_multiple_of_the_step_within_the_bounds() -> None:
    lengths = [warmup_length(k / 100, 0.5, 16, 1024, 8) for k in range(101)]
    assert lengths[0] == 16 and lengths[50] == lengths[100] == 1024
    assert all(length % 8 == 0 and 16 <= length <= 1024 for length in lengths)
    assert lengths == sorted(lengths)


def test_reshaping_keeps_every_whole_sequence_of_tokens() -> None:
    batch = _batch()
    reshaped = set_batch_sequence_length(batch, 24, truncate=False)  # 64 = 2 * 24 + 16: 16 tokens per row dropped
    ids = reshaped["input_ids"]
    assert ids.shape == (8, 24)
    assert torch.equal(ids, batch["input_ids"][:, :48].reshape(8, 24))  # type: ignore[index]
    assert reshaped["attention_mask"].shape == (8, 24)


def test_a_batch_without_input_ids_is_refused() -> None:
    with pytest.raises(TypeError, match="'input_ids' tensor"):
        set_batch_sequence_length((torch.zeros(2, 8),), 4)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"duration": 0.0}, r"duration=0.0 must be a fraction of training in \(0, 1\]"),
        ({"min_seq_length": 0}, "min_seq_length=0"),
        ({"min_seq_length": 64, "max_seq_length": 32}, "min_seq_length=64 must not exceed max_seq_length=32"),
        ({"step_size": 0}, "step_size=0"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SeqLengthWarmup(**kwargs)  # type: ignore[arg-type]
