"""Resuming a dataloader mid-epoch: the rest of the epoch and the next epoch match an uninterrupted run, and
skipped samples are not fetched unless the sampler forces a replay."""

from __future__ import annotations

import io
import multiprocessing
import random
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from fabric.trainer.checkpoint.dataloader_position import capture_epoch_start, resume_iterator
from fabric.trainer.checkpoint.rng import capture_rng_state, restore_rng_state
from fabric.utilities.data import ShardedSampler, shard_dataloader
from fabric.wrappers import wrap_dataloader

SAMPLES = 20
REPLAY_WARNING = "fetches and drops"


class Counter:
    """A call counter shared with forked DataLoader workers."""

    def __init__(self) -> None:
        self._value = multiprocessing.get_context("fork").Value("i", 0)

    def add(self) -> None:
        with self._value.get_lock():
            self._value.value += 1

    @property
    def value(self) -> int:
        return int(self._value.value)


class Samples(Dataset[torch.Tensor]):
    """Sample ``i`` is ``[i, noise]``; the noise is drawn from the global generator, like an augmentation."""

    def __init__(self, augment: bool) -> None:
        self.augment = augment
        self.fetched = Counter()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> torch.Tensor:
        self.fetched.add()
        noise = torch.randint(0, 1_000_000, ()) if self.augment else torch.tensor(0)
        return torch.stack([torch.tensor(index), noise])


class Stream(IterableDataset[torch.Tensor]):
    """The iterable version of :class:`Samples`."""

    def __init__(self, augment: bool) -> None:
        self.samples = Samples(augment)
        self.fetched = self.samples.fetched

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self.samples[index] for index in range(SAMPLES))


class ShuffledBatches(Sampler[list[int]]):
    """A custom batch sampler shuffling with Python's ``random``: an order the resume logic does not know."""

    def __init__(self, size: int, batch_size: int) -> None:
        self.size, self.batch_size = size, batch_size

    def __iter__(self) -> Iterator[list[int]]:
        order = list(range(self.size))
        random.shuffle(order)
        return iter([order[start : start + self.batch_size] for start in range(0, self.size, self.batch_size)])

    def __len__(self) -> int:
        return -(-self.size // self.batch_size)


def _random(dataset: Any, **options: Any) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=3, shuffle=True, **options)


def _random_with_generator(dataset: Any, **options: Any) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(7), **options)


def _sequential(dataset: Any, **options: Any) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=3, sampler=SequentialSampler(dataset), **options)


def _distributed(rank: int) -> Callable[..., DataLoader[Any]]:
    def build(dataset: Any, **options: Any) -> DataLoader[Any]:
        sampler: DistributedSampler[int] = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=5)
        return DataLoader(dataset, batch_size=3, sampler=sampler, **options)

    return build


def _sharded_random(dataset: Any, **options: Any) -> DataLoader[Any]:
    return DataLoader(
        dataset, batch_size=3, sampler=ShardedSampler(RandomSampler(dataset), num_replicas=2, rank=1), **options
    )


def _sharded_unbatched(dataset: Any, **options: Any) -> DataLoader[Any]:
    # ShardedSampler draws when iter() is called, unlike the generator-based samplers, which draw at next().
    sampler = ShardedSampler(RandomSampler(dataset), num_replicas=2, rank=0)
    return DataLoader(dataset, batch_size=None, sampler=sampler, **options)


def _batch_sampler_with_replacement(dataset: Any, **options: Any) -> DataLoader[Any]:
    sampler = RandomSampler(dataset, replacement=True, num_samples=25, generator=torch.Generator().manual_seed(3))
    return DataLoader(dataset, batch_sampler=BatchSampler(sampler, batch_size=4, drop_last=True), **options)


def _unbatched(dataset: Any, **options: Any) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=None, shuffle=True, **options)


def _custom_batch_sampler(dataset: Any, **options: Any) -> DataLoader[Any]:
    return DataLoader(dataset, batch_sampler=ShuffledBatches(len(dataset), 3), **options)


def _stream(dataset: Any, **options: Any) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=3, **options)


#: name: (builds the loader from a dataset, the dataset is iterable, skipping happens by index)
KINDS: dict[str, tuple[Callable[..., DataLoader[Any]], bool, bool]] = {
    "random": (_random, False, True),
    "random_generator": (_random_with_generator, False, True),
    "sequential": (_sequential, False, True),
    "distributed_rank0": (_distributed(0), False, True),
    "distributed_rank1": (_distributed(1), False, True),
    "sharded_sampler": (_sharded_random, False, True),
    "sharded_unbatched": (_sharded_unbatched, False, True),
    "batch_sampler": (_batch_sampler_with_replacement, False, True),
    "unbatched": (_unbatched, False, True),
    "custom_batch_sampler": (_custom_batch_sampler, False, False),
    "iterable_dataset": (_stream, True, False),
}
WRAPPINGS = ("plain", "fabric", "fabric_sharded")


def _build(kind: str, wrapping: str, augment: bool = True, **loader_options: Any) -> DataLoader[Any]:
    make, iterable, _ = KINDS[kind]
    loader = make(Stream(augment) if iterable else Samples(augment), **loader_options)
    if wrapping == "plain":
        return loader
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "cannot shard an IterableDataset"
        sharded = shard_dataloader(loader, num_replicas=2, rank=1) if wrapping == "fabric_sharded" else loader
    return wrap_dataloader(sharded, device=None)


def _announce_epoch(loader: DataLoader[Any], epoch: int) -> None:
    """What a user's loop does for a plain loader with a DistributedSampler (Fabric's wrapper does it itself)."""
    if not hasattr(loader, "_fabric_epoch") and isinstance(loader.sampler, DistributedSampler):
        loader.sampler.set_epoch(epoch)


def _train_over(batches: Iterator[Any]) -> list[torch.Tensor]:
    """Every batch, drawing random numbers between batches as a training step (dropout) would."""
    seen = []
    for batch in batches:
        seen.append(batch)
        torch.rand(3)
        random.random()
    return seen


def _through_checkpoint(value: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _assert_same_batches(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for position, (got, want) in enumerate(zip(actual, expected, strict=True)):
        assert torch.equal(got, want), f"batch {position}: {got.tolist()} != {want.tolist()}"


def _samples_in(batches: list[torch.Tensor]) -> int:
    return sum(1 if batch.dim() == 1 else batch.shape[0] for batch in batches)


def _check_resume(build: Callable[[], DataLoader[Any]], batches_done: int, skip_by_index: bool) -> DataLoader[Any]:
    """Run an epoch (after a first one), checkpoint after ``batches_done`` batches, resume on a fresh loader."""
    torch.manual_seed(0)
    random.seed(0)
    loader = build()
    _announce_epoch(loader, 0)
    _train_over(iter(loader))
    _announce_epoch(loader, 1)
    epoch_start = _through_checkpoint(capture_epoch_start(loader))
    batches = iter(loader)
    skipped = _train_over(next(batches) for _ in range(batches_done))
    checkpoint_rng = _through_checkpoint(capture_rng_state())
    expected_rest = _train_over(batches)
    _announce_epoch(loader, 2)
    expected_next = _train_over(iter(loader))

    torch.manual_seed(1)  # a new process: other random state until the checkpoint's is restored
    random.seed(1)
    resumed = build()
    restore_rng_state(checkpoint_rng)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rest = _train_over(resume_iterator(resumed, epoch_start, batches_done))
    fetched = resumed.dataset.fetched.value  # type: ignore[attr-defined]
    _announce_epoch(resumed, 2)
    next_epoch = _train_over(iter(resumed))

    _assert_same_batches(rest, expected_rest)
    _assert_same_batches(next_epoch, expected_next)
    replay_warnings = [str(warning.message) for warning in caught if REPLAY_WARNING in str(warning.message)]
    if skip_by_index:
        assert fetched == _samples_in(expected_rest)
        assert replay_warnings == []
    else:
        assert fetched == _samples_in(skipped) + _samples_in(expected_rest)
        assert len(replay_warnings) == (1 if batches_done else 0)
    return resumed


@pytest.mark.parametrize("wrapping", WRAPPINGS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_resumed_epoch_and_next_epoch_match_an_uninterrupted_run(kind: str, wrapping: str) -> None:
    skip_by_index = KINDS[kind][2]
    _check_resume(lambda: _build(kind, wrapping), batches_done=2, skip_by_index=skip_by_index)


@pytest.mark.parametrize("batches_done", [0, 1, 4])
def test_resume_at_the_epoch_start_and_end(batches_done: int) -> None:
    # 20 samples on rank 1 of 2 in batches of 3: 4 batches, so 4 resumes at the epoch's very end.
    _check_resume(lambda: _build("random", "fabric_sharded"), batches_done, skip_by_index=True)


@pytest.mark.parametrize(
    ("kind", "wrapping", "persistent_workers"),
    [
        ("random", "fabric", False),
        ("random", "fabric_sharded", True),
        ("sharded_unbatched", "plain", False),
        ("sharded_unbatched", "fabric", True),
        ("custom_batch_sampler", "plain", True),
    ],
)
def test_resume_with_worker_processes(kind: str, wrapping: str, persistent_workers: bool) -> None:
    # Workers draw augmentation noise from their own generators, which a resume cannot reproduce: no noise here.
    options = {"num_workers": 2, "persistent_workers": persistent_workers, "multiprocessing_context": "fork"}
    resumed = _check_resume(
        lambda: _build(kind, wrapping, augment=False, **options), batches_done=2, skip_by_index=KINDS[kind][2]
    )
    if persistent_workers:  # the resumed epoch's workers serve the next epochs too
        assert resumed._iterator is not None


def test_the_current_random_state_survives_the_resume() -> None:
    loader = _build("random", "fabric", augment=False)
    epoch_start = capture_epoch_start(loader)
    list(loader)
    torch.manual_seed(99)
    random.seed(99)
    before = capture_rng_state()
    list(resume_iterator(_build("random", "fabric", augment=False), epoch_start, batches_done=2))
    after = capture_rng_state()
    torch.testing.assert_close(after, before, rtol=0, atol=0, equal_nan=True)  # Python's "no cached gauss" is NaN


def test_batches_still_move_to_the_loader_device() -> None:
    loader = wrap_dataloader(_random(Samples(augment=False)), device=torch.device("meta"))
    epoch_start = capture_epoch_start(loader)
    rest = list(resume_iterator(loader, epoch_start, batches_done=3))
    assert [batch.device.type for batch in rest] == ["meta"] * 4  # 20 samples in batches of 3: 7, 3 skipped


def test_dataset_state_is_restored_and_must_be_loadable() -> None:
    class Shifted(Samples):
        def __init__(self) -> None:
            super().__init__(augment=False)
            self.shift: Any = 0

        def __getitem__(self, index: int) -> torch.Tensor:
            return super().__getitem__(index) + int(self.shift)

        def state_dict(self) -> dict[str, Any]:
            return {"shift": self.shift}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.shift = state["shift"]

    dataset = Shifted()
    dataset.shift = 100
    loader = DataLoader(dataset, batch_size=4)
    epoch_start = _through_checkpoint(capture_epoch_start(loader))
    dataset.shift = 0  # e.g. the checkpoint is loaded into a freshly built dataset
    rest = list(resume_iterator(loader, epoch_start, batches_done=4))
    assert [row[0].item() for row in rest[0]] == [116, 117, 118, 119]

    dataset.shift = {"not", "a", "tensor"}
    with pytest.raises(TypeError, match=r"Shifted.state_dict\(\)\['shift'\] holds a set"):
        capture_epoch_start(loader)


def test_bad_arguments_fail_before_anything_changes() -> None:
    loader = _build("random", "fabric")
    epoch_start = capture_epoch_start(loader)
    with pytest.raises(ValueError, match=r"batches_done=-1 must be a non-negative int"):
        resume_iterator(loader, epoch_start, -1)
    with pytest.raises(ValueError, match=r"batches_done=8 is more than the 7 batches of this epoch"):
        resume_iterator(loader, epoch_start, 8)
    with pytest.raises(ValueError, match=r"epoch_start must be a dict returned by capture_epoch_start"):
        resume_iterator(loader, {"epoch": 1}, 1)
    with pytest.raises(ValueError, match=r"samplers \['DistributedSampler', 'BatchSampler'\] differ"):
        resume_iterator(_build("random", "fabric_sharded"), epoch_start, 1)
    with pytest.raises(ValueError, match=r"captured from a Fabric-wrapped dataloader"):
        resume_iterator(_build("random", "plain"), epoch_start, 1)
    with pytest.raises(ValueError, match=r"has 1 torch.Generator objects but 0 were captured"):
        resume_iterator(_build("random_generator", "fabric"), epoch_start, 1)


def test_replay_warning_names_the_sampler_and_the_way_out() -> None:
    loader = _build("custom_batch_sampler", "plain")
    epoch_start = capture_epoch_start(loader)
    with pytest.warns(
        UserWarning, match=r"drops 2 finished batches, because the sampler \(ShuffledBatches\)"
    ) as caught:
        list(resume_iterator(loader, epoch_start, batches_done=2))
    assert "RandomSampler, SequentialSampler or DistributedSampler" in str(caught[0].message)
    with pytest.warns(UserWarning, match=r"the dataset \(Stream, an IterableDataset\)"):
        stream = _build("iterable_dataset", "plain")
        list(resume_iterator(stream, capture_epoch_start(stream), batches_done=1))


def test_a_resumed_epoch_can_be_resumed_again_from_the_same_epoch_start() -> None:
    torch.manual_seed(0)  # no augmentation: the random state is the subject of the tests above
    loader = _build("random", "fabric", augment=False)
    epoch_start = _through_checkpoint(capture_epoch_start(loader))
    expected = _train_over(iter(loader))

    first_resume = resume_iterator(_build("random", "fabric", augment=False), epoch_start, batches_done=2)
    seen = [next(first_resume) for _ in range(3)]  # batches 2, 3, 4; then the process dies again
    rest = list(resume_iterator(_build("random", "fabric", augment=False), epoch_start, batches_done=5))
    _assert_same_batches([*expected[:2], *seen, *rest], expected)
