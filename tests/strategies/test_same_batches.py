"""Ranks that hold parts of one model copy must be fed the same batches: a loader that gives them different ones
(as one sharding itself over every rank does) fails at the first forward, instead of training silently wrong.

Real processes (tests/scripts/different_batches_job.py): 2 ranks of one tensor-parallel group, and 2 pipeline stages,
each given a batch drawn from its own rank's seed. That equal batches pass is shown by every other model-parallel
and pipeline test (their loaders go through ``setup_dataloaders``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import UserDict
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fabric.strategies.same_batches import batch_fingerprint

SCRIPT = Path(__file__).parents[1] / "scripts" / "different_batches_job.py"


@pytest.mark.parametrize(("kind", "sharers"), [("tensor", "tensor_parallel=2"), ("pipeline", "pipeline_parallel=2")])
def test_different_batches_on_one_model_copy_fail_at_the_first_forward(tmp_path: Path, kind: str, sharers: str) -> None:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), kind], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in (0, 1):
        message = (tmp_path / f"rank-{rank}.txt").read_text()
        assert message.startswith(f"Ranks 0 and 1 hold parts of one model copy ({sharers}) and must be given the same")
        assert "split it over the data-parallel ranks only" in message


def test_the_fingerprint_tells_other_samples_and_other_orders_apart() -> None:
    batch = {"tokens": torch.arange(12).view(4, 3), "mask": torch.ones(4, 3, dtype=torch.bool)}
    same = {"tokens": torch.arange(12).view(4, 3), "mask": torch.ones(4, 3, dtype=torch.bool)}
    reordered = {"tokens": batch["tokens"].flip(0), "mask": batch["mask"]}
    other = {"tokens": batch["tokens"] + 1, "mask": batch["mask"]}
    assert batch_fingerprint(batch) == batch_fingerprint(same)
    assert batch_fingerprint(batch) != batch_fingerprint(reordered)  # the same sum, other positions
    assert batch_fingerprint(batch) != batch_fingerprint(other)
    assert batch_fingerprint(((torch.zeros(2),), {"target": None})) == [((2,), "torch.float32", 0.0, 0.0)]


class _BatchEncoding(UserDict):  # type: ignore[type-arg]
    """Like Hugging Face's ``BatchEncoding`` (llm-foundry's batches): a mapping torch's pytree takes for one leaf."""


@dataclass
class _Batch:
    tokens: torch.Tensor


def test_the_fingerprint_sees_the_tensors_in_mappings_pytree_does_not_know_and_in_dataclasses() -> None:
    tokens = torch.arange(12).view(4, 3)
    assert batch_fingerprint(((_BatchEncoding(input_ids=tokens),), {})) == batch_fingerprint(tokens)
    assert batch_fingerprint(_BatchEncoding(input_ids=tokens)) != batch_fingerprint(
        _BatchEncoding(input_ids=tokens + 1)
    )
    assert batch_fingerprint(_Batch(tokens)) == batch_fingerprint(tokens) != []
