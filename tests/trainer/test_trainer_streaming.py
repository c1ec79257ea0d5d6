"""Data that streams and resumes: a streaming-style dataset and loader (``tests/streaming_double.py``, the API of
mosaicml-streaming) through Fabric and the Trainer, crashed mid-epoch and resumed on another number of ranks."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from streaming_double import StreamingLikeDataset, StreamingLikeLoader
from torch.utils.data import DataLoader, IterableDataset

from fabric import Fabric
from fabric.trainer.checkpoint.dataloader_position import capture_epoch_start
from fabric.utilities.data import shard_dataloader

#: Slow: the Trainer on streaming datasets across real ranks (`bash scripts/test.sh --end-to-end`; CI runs it).
pytestmark = pytest.mark.end_to_end

TESTS = Path(__file__).parents[1]
SCRIPT = TESTS / "scripts" / "trainer_streaming.py"
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def _run(out: Path, devices: int, crash_at: int, run: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(out), str(devices), str(crash_at), run, *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(("before", "after"), [(2, 1), (2, 2), (1, 2)], ids=["2-to-1", "2-to-2", "1-to-2"])
def test_a_crash_mid_epoch_resumes_with_every_sample_once_per_epoch(before: int, after: int, tmp_path: Path) -> None:
    """The Trainer called StreamingDataset.state_dict() without its two arguments and crashed before the first
    batch; in-script launches gave rank 0 no RANK/WORLD_SIZE, so the dataset did not shard. Now the loader's own
    state is the position, and the run goes on where it crashed on any number of ranks."""
    crash_at = 11 if before == 2 else 22  # mid-epoch 1: batch 3 of 8 (2 ranks), or 6 of 16 (1 rank)
    crashed = _run(tmp_path, before, crash_at, "first")
    assert crashed.returncode != 0, crashed.stderr[-2000:]
    assert not list((tmp_path / "ckpt").glob("*.tmp-*"))
    resumed = _run(tmp_path, after, 0, "second")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    _assert_each_sample_once_per_epoch(tmp_path)
    first_run_ids = {line.split()[1] for log in tmp_path.glob("ids-first-*") for line in log.read_text().splitlines()}
    assert len(first_run_ids) == 64  # the first run did train a whole epoch before crashing


def _assert_each_sample_once_per_epoch(out: Path, epochs: int = 3, samples: int = 64) -> None:
    trained: collections.Counter[tuple[int, int]] = collections.Counter()
    for log in out.glob("ids-*-rank*.txt"):
        for line in log.read_text().splitlines():
            epoch, sample = map(int, line.split())
            trained[(epoch, sample)] += 1
    for epoch in range(epochs):
        assert {sample: trained[(epoch, sample)] for sample in range(samples)} == dict.fromkeys(range(samples), 1)
    assert sum(trained.values()) == epochs * samples  # no sample outside the dataset, no extra epoch


@pytest.mark.parametrize(
    ("after", "batch_after"), [(1, 4), (2, 8), (2, 2)], ids=["2-to-1-ranks", "batch-4-to-8", "batch-4-to-2"]
)
def test_a_map_style_epoch_resumed_with_another_layout_trains_the_rest_once(
    after: int, batch_after: int, tmp_path: Path
) -> None:
    """Resumed with another batch size, the epoch skipped batches of the new size (40 samples of an epoch never
    trained with 16, 20 trained twice with 4); with another world size, it skipped batches of a new order."""
    crashed = _run(tmp_path, 2, 11, "first", "map", "4")
    assert crashed.returncode != 0, crashed.stderr[-2000:]
    resumed = _run(tmp_path, after, 0, "second", "map", str(batch_after))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "not trained yet are dealt to this run's data shares, each once" in resumed.stderr
    _assert_each_sample_once_per_epoch(tmp_path)


@pytest.mark.parametrize(("after", "tensor_after"), [(2, 1), (4, 1), (4, 2)], ids=["to-2-ddp", "to-4-ddp", "to-4-tp2"])
def test_a_tensor_parallel_epoch_resumed_trains_the_rest_once(after: int, tensor_after: int, tmp_path: Path) -> None:
    """4 ranks with tensor parallelism 2 read 2 shares of the data, but the position recorded 4: resumed on 2 ranks
    the epoch was dealt as if twice the samples had been trained (those never trained), and on 4 plain ranks the
    shards of another layout were skipped as if they were the saved ones, both without a word."""
    crashed = _run(tmp_path, 4, 11, "first", "map", "4", "64", "2")
    assert crashed.returncode != 0, crashed.stderr[-2000:]
    resumed = _run(tmp_path, after, 0, "second", "map", "4", "64", str(tensor_after))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    changed = after // tensor_after != 2
    assert ("not trained yet are dealt to this run's data shares" in resumed.stderr) == changed, resumed.stderr[-2000:]
    _assert_each_sample_once_per_epoch(tmp_path)


@pytest.mark.parametrize(
    ("resume", "message"),
    [
        (("map", "16"), "this run has batch size 8 -> 16; the epoch's order depends on"),
        (("map", "8", "80"), "a dataset of 64 samples; this run's dataset has 80"),
    ],
    ids=["another-batch-size-of-a-random-sampler", "another-dataset-length"],
)
def test_a_position_that_cannot_be_kept_is_refused_naming_what_changed(
    resume: tuple[str, ...], message: str, tmp_path: Path
) -> None:
    """A changed dataset length gave 10-26 duplicates without a word; one process's RandomSampler draws an order
    that depends on the world, so another batch size there cannot be resumed by samples."""
    crashed = _run(tmp_path, 1, 5, "first", "map", "8")
    assert crashed.returncode != 0, crashed.stderr[-2000:]
    refused = _run(tmp_path, 1, 0, "second", *resume)
    assert refused.returncode != 0
    assert message in refused.stderr and "load_ignore_keys=['dataloader']" in refused.stderr, refused.stderr[-2000:]
    assert "Nothing was changed" in refused.stderr


def test_an_epoch_start_capture_never_calls_a_state_dict_that_needs_arguments() -> None:
    """StreamingDataset.state_dict(num_samples, from_beginning): calling it bare raised a TypeError."""
    loader = StreamingLikeLoader(StreamingLikeDataset(8), batch_size=4)
    captured = capture_epoch_start(loader)
    assert captured["dataset_state"] is None


def test_the_users_own_loader_follows_the_iteration_of_the_one_fabric_returns() -> None:
    """state_dict() was current only on the copy setup_dataloaders returned, so saving the user's loader saved
    the start of the epoch."""
    fabric = Fabric(accelerator="cpu", devices=1)
    built = StreamingLikeLoader(StreamingLikeDataset(16), batch_size=4)
    loader = fabric.setup_dataloaders(built)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    assert built.state_dict()["sample_in_epoch"] == 12
    assert loader.state_dict() == built.state_dict()


class _PlainIterable(IterableDataset[int]):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(8))


def test_only_an_iterable_dataset_that_does_not_shard_itself_is_warned_about() -> None:
    """ "Fabric cannot shard" was said of datasets that shard themselves by rank (mosaicml-streaming's)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shard_dataloader(DataLoader(StreamingLikeDataset(8), batch_size=2), num_replicas=2, rank=0)
    with pytest.warns(UserWarning, match=r"_PlainIterable.*every rank trains on the same samples.*shards_by_rank"):
        shard_dataloader(DataLoader(_PlainIterable(), batch_size=2), num_replicas=2, rank=0)


def test_a_loader_that_keeps_its_own_position_round_trips_through_fabric_save(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    loader = fabric.setup_dataloaders(StreamingLikeLoader(StreamingLikeDataset(16, seed=3), batch_size=4))
    batches = iter(loader)
    seen = [next(batches)["id"] for _ in range(2)]
    fabric.save(tmp_path / "ckpt.pt", {"loader": loader})

    fresh = fabric.setup_dataloaders(StreamingLikeLoader(StreamingLikeDataset(16, seed=3), batch_size=4))
    fabric.load(tmp_path / "ckpt.pt", {"loader": fresh})
    rest = [batch["id"] for batch in fresh]
    assert sorted(torch.cat(seen + rest).tolist()) == list(range(16))
    assert len(rest) == 2
