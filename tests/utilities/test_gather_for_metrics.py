"""``fabric.gather_for_metrics``: per-sample results of all ranks without the samples the sampler repeated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Sampler, SequentialSampler, TensorDataset

from fabric import Fabric
from fabric.utilities.data import shard_dataloader
from fabric.utilities.metrics_gather import SampleSharding, sample_sharding, unpadded_rows

SCRIPT = Path(__file__).parents[1] / "scripts" / "gather_for_metrics.py"


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("gather")
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, str(SCRIPT), str(out)], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "report.json").read_text())


def test_101_samples_over_two_ranks_count_101(report: dict) -> None:
    assert report["all_gather_rows"] == 102  # what all_gather gives: sample 0 twice
    assert report["in_order"] == list(range(101))  # every sample once, in dataset order
    assert report["correct_count"] == 34  # 0, 3, ..., 99: the repeated sample 0 counted once


def test_every_pass_counts_afresh(report: dict) -> None:
    assert report["shuffled_epochs"] == [list(range(101))] * 2
    assert report["after_a_broken_pass"] == list(range(101))
    assert report["whole_pass_at_once"] == list(range(101))
    assert (
        "this rank gave 102 rows in this pass over the dataloader, more than its 51 samples"
        in (report["too_many_rows"])
    )


def test_rows_go_back_to_their_sample_positions() -> None:
    # 7 samples over 3 ranks, 3 each: rank q holds positions q, q + 3, q + 6 (7 and 8 repeat samples 0 and 1)
    per_rank = torch.tensor([[0, 3, 6], [1, 4, 0], [2, 5, 1]])
    sharding = SampleSharding(num_replicas=3, rank=0, share=3, real=7)
    assert unpadded_rows(per_rank, [0, 1, 2], sharding, before=0).tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert unpadded_rows(per_rank[:, 2:], [0, 1, 2], sharding, before=2).tolist() == [6]  # the last batch
    # processes that share a sampler rank (tensor parallelism) count once
    doubled = torch.tensor([[0, 2], [0, 2], [1, 0], [1, 0]])
    sharding = SampleSharding(num_replicas=2, rank=0, share=2, real=3)
    assert unpadded_rows(doubled, [0, 0, 1, 1], sharding, before=0).tolist() == [0, 1, 2]


class _EveryOther(Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(0, self.n, 2))

    def __len__(self) -> int:
        return (self.n + 1) // 2


def test_custom_samplers_are_handled_and_batch_level_sharding_refused() -> None:
    data = TensorDataset(torch.arange(9))
    sharded = shard_dataloader(DataLoader(data, sampler=_EveryOther(9), batch_size=2), num_replicas=2, rank=1)
    assert sample_sharding(sharded) == SampleSharding(num_replicas=2, rank=1, share=3, real=5)
    batches = BatchSampler(SequentialSampler(data), batch_size=2, drop_last=False)
    custom = type("MyBatchSampler", (BatchSampler,), {})(SequentialSampler(data), 2, False)
    assert sample_sharding(shard_dataloader(DataLoader(data, batch_sampler=batches), 2, 0)) is not None
    with pytest.raises(ValueError, match="sharded by whole batches"):
        sample_sharding(shard_dataloader(DataLoader(data, batch_sampler=custom), 2, 0))


def test_one_process_gives_the_rows_back_and_bad_input_is_named() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    plain = DataLoader(TensorDataset(torch.arange(5)), batch_size=2)
    loader = fabric.setup_dataloaders(plain)
    assert torch.cat([fabric.gather_for_metrics(x, loader) for (x,) in loader]).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="first dimensions \\[2, 3\\]"):
        fabric.gather_for_metrics({"a": torch.zeros(2), "b": torch.zeros(3)}, loader)
    fabric2 = Fabric(accelerator="cpu", devices=1)
    data = TensorDataset(torch.arange(5))
    sharded = shard_dataloader(DataLoader(data, batch_size=2, shuffle=True), 1, 0)  # sharded but not set up
    with pytest.raises(ValueError, match=r"needs a dataloader returned by fabric\.setup_dataloaders"):
        fabric2.gather_for_metrics(torch.zeros(2), sharded)
