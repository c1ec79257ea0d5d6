"""Resume a dataloader mid-epoch: rebuild the epoch's batch order and skip the finished batches by index.

At every epoch start the Trainer calls :func:`capture_epoch_start`, which records what the loader's
order depends on: the random generators (the global ones, the loader's and samplers' own
``torch.Generator``), the samplers' epochs, Fabric's epoch counter and the dataset's ``state_dict()``.
:func:`resume_iterator` puts that state back, lets the loader draw exactly what it drew at the real
epoch start, and feeds the loader an index stream that starts after the finished batches, so skipped
samples are never fetched or collated. Only samplers whose order is a function of that state are
skipped this way (see :data:`UNDERSTOOD_SAMPLERS`); for others the finished batches are fetched and
dropped ("replayed"), with a warning.

With persistent workers, the copy's workers are handed to the loader at the end of the resumed epoch,
so later epochs reuse them as an uninterrupted run would. To resume a resumed epoch again, pass the
same epoch start and count ``batches_done`` from the epoch's beginning.

What stays approximate: random numbers drawn inside worker processes (``num_workers > 0``) depend on
how many samples each worker fetched before, so random augmentation there differs after a resume
(with ``num_workers=0`` it is exact, because the caller restores the global generators).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from fabric.trainer.checkpoint.rng import RngSnapshot, capture_rng_state, restore_rng_state
from fabric.utilities.data import ShardedSampler
from fabric.utilities.rank_zero import rank_zero_warn
from fabric.wrappers import FabricDataLoader

#: Samplers whose index order depends only on captured state; batch samplers and Fabric's sharding
#: wrapper around them are understood too.
UNDERSTOOD_SAMPLERS: tuple[type[Any], ...] = (RandomSampler, SequentialSampler, DistributedSampler)
_UNDERSTOOD_WRAPPERS: tuple[type[Any], ...] = (BatchSampler, ShardedSampler)
_FORMAT = 1


def capture_epoch_start(dataloader: Iterable[Any]) -> dict[str, Any]:
    """What rebuilds this epoch's batch order; call it right before ``iter(dataloader)`` starts the epoch.

    Exact when nothing draws random numbers between this call and the loader's first draw (``iter()``
    for a plain DataLoader, the first ``next()`` for a Fabric-wrapped one). The result holds only
    tensors, ints, bools, strings, lists and dicts, so it loads with ``torch.load(weights_only=True)``.
    """
    return EpochStart.take(dataloader).record()


@dataclasses.dataclass(frozen=True)
class EpochStart:
    """What :func:`capture_epoch_start` records, with the generator states still an :class:`RngSnapshot`: the
    Trainer takes one at every epoch start and builds the record only when a checkpoint needs it."""

    #: The record without its ``"rng"`` entry.
    fields: dict[str, Any]
    rng: RngSnapshot

    @classmethod
    def take(cls, dataloader: Iterable[Any]) -> EpochStart:
        samplers = _sampler_chain(dataloader)
        dataset: Any = getattr(dataloader, "dataset", None)
        dataset_state = dataset.state_dict() if has_state_protocol(dataset) else None
        if dataset_state is not None:
            _check_loadable(dataset_state, f"{type(dataset).__name__}.state_dict()")
        fields = {
            "format": _FORMAT,
            "samplers": [type(sampler).__name__ for sampler in samplers],
            "generators": [generator.get_state() for generator in _generators(dataloader, samplers)],
            "sampler_epochs": [sampler.epoch for sampler in samplers if _has_epoch(sampler)],
            "fabric_epoch": dataloader._fabric_epoch if isinstance(dataloader, FabricDataLoader) else None,
            "draws_base_seed": not _has_live_workers(dataloader),
            "dataset_state": dataset_state,
        }
        # Over a sampler whose order is known, only torch draws before the resumed epoch is positioned (the order,
        # the workers' base seed), and the current states come back before any fetch: torch's states suffice.
        return cls(fields, RngSnapshot.take(torch_only=_index_skip_obstacle(dataloader) is None))

    def record(self) -> dict[str, Any]:
        """The record :func:`capture_epoch_start` returns."""
        return {**self.fields, "rng": self.rng.as_tensors()}


def epoch_start_record(epoch_start: EpochStart | dict[str, Any]) -> dict[str, Any]:
    """The record of an epoch start, taken now (an :class:`EpochStart`) or read from a checkpoint (already one)."""
    return epoch_start.record() if isinstance(epoch_start, EpochStart) else epoch_start


def has_state_protocol(obj: object) -> bool:
    """Whether ``obj`` saves and restores its own state: ``state_dict()`` takes no argument and
    ``load_state_dict(state)`` one. A method of another signature (mosaicml-streaming's
    ``StreamingDataset.state_dict(num_samples, from_beginning)``) is never called blindly."""
    return _callable_with(getattr(obj, "state_dict", None), 0) and _callable_with(
        getattr(obj, "load_state_dict", None), 1
    )


def keeps_own_position(dataloader: object) -> bool:
    """Whether the loader itself knows how far into the epoch it is and resumes there (mosaicml-streaming's
    ``StreamingDataLoader``, torchdata's ``StatefulDataLoader``): then its ``state_dict()`` is the position."""
    return has_state_protocol(dataloader)


def capture_loader_state(dataloader: Any) -> Any:
    """The position of a loader that :func:`keeps_own_position`, checked to load with ``weights_only=True``."""
    state = dataloader.state_dict()
    _check_loadable(state, f"{type(dataloader).__name__}.state_dict()")
    return state


def _callable_with(function: object, arguments: int) -> bool:
    if not callable(function):
        return False
    try:
        inspect.signature(function).bind(*([None] * arguments))
    except (TypeError, ValueError):
        return False
    return True


def resume_iterator(dataloader: Iterable[Any], epoch_start: dict[str, Any], batches_done: int) -> Iterator[Any]:
    """The rest of the epoch that began at ``epoch_start``, from batch ``batches_done`` on.

    Yields the batches an uninterrupted iterator would have yielded from there (same samples, order,
    collation and device). The global random state current at the first ``next()`` is what fetching
    continues with (with ``batches_done=0`` the loader's own first draws come from it too, as a
    checkpoint taken before the first batch is also taken before them), and once exhausted the loader is
    as after an uninterrupted epoch, so the next epoch's shuffle matches too. Skips by index for
    :data:`UNDERSTOOD_SAMPLERS` over a map-style dataset; otherwise fetches and drops the finished batches,
    warning once which sampler or dataset forced it.
    """
    _check_epoch_start(dataloader, epoch_start)
    if isinstance(batches_done, bool) or not isinstance(batches_done, int) or batches_done < 0:
        raise ValueError(f"batches_done={batches_done!r} must be a non-negative int.")
    obstacle = _index_skip_obstacle(dataloader)
    if obstacle is None:
        assert isinstance(dataloader, DataLoader)
        total = len(dataloader._index_sampler)
        if batches_done > total:
            raise ValueError(f"batches_done={batches_done} is more than the {total} batches of this epoch.")
    elif batches_done > 0:
        rank_zero_warn(
            f"Resuming mid-epoch fetches and drops {batches_done} finished batches, because {obstacle} has no "
            "known index order. To resume without fetching them, use a map-style dataset with a RandomSampler, "
            "SequentialSampler or DistributedSampler (alone, in a torch BatchSampler, or sharded by Fabric)."
        )
    return _resumed_batches(dataloader, epoch_start, batches_done, skip_by_index=obstacle is None)


def _resumed_batches(
    dataloader: Iterable[Any], epoch_start: dict[str, Any], batches_done: int, skip_by_index: bool
) -> Iterator[Any]:
    """The resumed epoch; all state juggling happens on the first ``next()``, where the caller's state is final."""
    restore_current = _Once(restore_rng_state, capture_rng_state())
    end = object()
    try:
        _restore_epoch_start(dataloader, epoch_start)
        if batches_done == 0:  # saved before the epoch's first fetch, so also before the loader drew anything
            restore_current()
        resumed = _resuming_copy(
            dataloader,
            epoch_start,
            skip=batches_done if skip_by_index else 0,
            on_positioned=restore_current if skip_by_index else None,
        )
        batches = iter(resumed)
        if not skip_by_index:
            next(itertools.islice(batches, batches_done, batches_done), None)  # fetch and drop
            restore_current()
        first = next(batches, end)  # with index skipping, the current state comes back before the fetch
    finally:
        restore_current()
    if first is not end:
        yield first
        yield from batches
    _hand_over_workers(dataloader, resumed)


class _Once:
    """Calls ``function(argument)`` the first time it is called, and does nothing after that."""

    def __init__(self, function: Callable[[Any], None], argument: object) -> None:
        self._function: Callable[[Any], None] | None = function
        self._argument = argument

    def __call__(self) -> None:
        function, self._function = self._function, None
        if function is not None:
            function(self._argument)


class _ResumedIndexStream:
    """Stands in for a loader's index sampler in the resuming copy: the sampler's stream from item ``skip`` on.

    ``on_positioned`` runs once the stream got there, after every random draw of the wrapped sampler
    (samplers draw at ``iter()`` or at their first item, so the first remaining item is taken first).
    Each ``iter()`` here calls ``iter()`` on the sampler at once, because the copy's new loader iterator
    calls it as often and at the same moments as the interrupted epoch's did; except that an epoch reusing
    persistent workers called it once less, which the first ``free_iters`` calls make up for by doing nothing.
    """

    def __init__(
        self, index_sampler: Iterable[Any], skip: int, on_positioned: Callable[[], None] | None, free_iters: int
    ) -> None:
        self.index_sampler = index_sampler
        self.skip = skip
        self.on_positioned = on_positioned
        self.free_iters = free_iters
        # Fabric's loader announces the epoch to ``batch_sampler.sampler``; keep that reaching the real one.
        self.sampler = getattr(index_sampler, "sampler", None)

    def __iter__(self) -> Iterator[Any]:
        if self.free_iters > 0:
            self.free_iters -= 1
            return iter(())
        return self._after_skip(iter(self.index_sampler))

    def _after_skip(self, indices: Iterator[Any]) -> Iterator[Any]:
        end = object()
        try:
            first = next(itertools.islice(indices, self.skip, None), end)
        finally:
            if self.on_positioned is not None:
                self.on_positioned()
        if first is not end:
            yield first
            yield from indices

    def __len__(self) -> int:
        return max(len(self.index_sampler) - self.skip, 0)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch, as Fabric's loader does for the sampler this one stands in for."""
        if callable(getattr(self.index_sampler, "set_epoch", None)):
            self.index_sampler.set_epoch(epoch)  # type: ignore[attr-defined]


# --- what the loader is made of ----------------------------------------------------------------------


def _sampler_chain(dataloader: Iterable[Any]) -> list[Any]:
    """The loader's sampler, batch sampler and the samplers they wrap, each once, in a fixed order."""
    chain: list[Any] = []
    pending = [getattr(dataloader, "sampler", None), getattr(dataloader, "batch_sampler", None)]
    while pending:
        sampler = pending.pop(0)
        if sampler is not None and all(sampler is not seen for seen in chain):
            chain.append(sampler)
            pending.append(getattr(sampler, "sampler", None))
    return chain


def _generators(dataloader: Iterable[Any], samplers: list[Any]) -> list[torch.Generator]:
    """The distinct ``torch.Generator`` objects of the loader and its samplers (often one shared object)."""
    found: list[torch.Generator] = []
    for owner in (dataloader, *samplers):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not seen for seen in found):
            found.append(generator)
    return found


def _has_epoch(sampler: object) -> bool:
    epoch = getattr(sampler, "epoch", None)
    return isinstance(epoch, int) and not isinstance(epoch, bool)


def _has_live_workers(dataloader: Iterable[Any]) -> bool:
    """Whether the next ``iter()`` reuses persistent workers, which drew their base seed in an earlier epoch."""
    return (
        isinstance(dataloader, DataLoader)
        and dataloader.persistent_workers
        and dataloader.num_workers > 0
        and getattr(dataloader, "_iterator", None) is not None
    )


def _index_skip_obstacle(dataloader: Iterable[Any]) -> str | None:
    """What prevents skipping by index (a description for the warning), or None when nothing does."""
    if not isinstance(dataloader, DataLoader):
        return f"the dataloader ({type(dataloader).__name__}, not a torch DataLoader)"
    if isinstance(dataloader.dataset, IterableDataset):
        return f"the dataset ({type(dataloader.dataset).__name__}, an IterableDataset)"
    sampler: Any = dataloader._index_sampler
    while type(sampler) in _UNDERSTOOD_WRAPPERS:
        sampler = sampler.sampler
    if type(sampler) in UNDERSTOOD_SAMPLERS:
        return None
    return f"the sampler ({type(sampler).__name__})"


# --- putting the epoch start back --------------------------------------------------------------------


def _check_epoch_start(dataloader: Iterable[Any], epoch_start: object) -> None:
    """Raise before anything changes unless ``epoch_start`` was captured from a loader built like this one."""
    if not isinstance(epoch_start, Mapping) or epoch_start.get("format") != _FORMAT:
        raise ValueError(
            f"epoch_start must be a dict returned by capture_epoch_start() (format {_FORMAT}), got "
            f"{type(epoch_start).__name__}{'' if not isinstance(epoch_start, Mapping) else ' of another format'}."
        )
    samplers = [type(sampler).__name__ for sampler in _sampler_chain(dataloader)]
    if samplers != epoch_start["samplers"]:
        raise ValueError(
            f"The dataloader's samplers {samplers} differ from the captured ones {epoch_start['samplers']}: "
            "resume with a dataloader built the same way as the one captured."
        )
    generators = len(_generators(dataloader, _sampler_chain(dataloader)))
    if generators != len(epoch_start["generators"]):
        raise ValueError(
            f"The dataloader has {generators} torch.Generator objects but {len(epoch_start['generators'])} were "
            "captured: resume with a dataloader built the same way as the one captured."
        )
    if (epoch_start["fabric_epoch"] is None) == isinstance(dataloader, FabricDataLoader):
        raise ValueError(
            "The epoch start was captured from a "
            f"{'plain' if epoch_start['fabric_epoch'] is None else 'Fabric-wrapped'} dataloader but "
            f"{type(dataloader).__name__} is not one: wrap (or do not wrap) it the same way before resuming."
        )


def _restore_epoch_start(dataloader: Iterable[Any], epoch_start: Mapping[str, Any]) -> None:
    """Random generators, sampler epochs and dataset state as at the epoch start; Fabric's counter past it."""
    samplers = _sampler_chain(dataloader)
    restore_rng_state(epoch_start["rng"])
    for generator, state in zip(_generators(dataloader, samplers), epoch_start["generators"], strict=True):
        generator.set_state(state)
    with_epoch = [sampler for sampler in samplers if _has_epoch(sampler)]
    for sampler, epoch in zip(with_epoch, epoch_start["sampler_epochs"], strict=True):
        sampler.epoch = epoch
    dataset = getattr(dataloader, "dataset", None)
    if epoch_start["dataset_state"] is not None and dataset is not None:
        dataset.load_state_dict(epoch_start["dataset_state"])
    if isinstance(dataloader, FabricDataLoader):
        dataloader._fabric_epoch = epoch_start["fabric_epoch"] + 1  # as its own __iter__ leaves it


def _resuming_copy(
    dataloader: Iterable[Any], epoch_start: Mapping[str, Any], skip: int, on_positioned: Callable[[], None] | None
) -> Iterable[Any]:
    """A copy of the loader (same class, so Fabric still moves batches) whose index stream starts at ``skip``.

    Plain iterables are returned as they are: they can only be replayed.
    """
    if not isinstance(dataloader, DataLoader):
        return dataloader
    resumed = copy.copy(dataloader)
    reused_workers = not epoch_start["draws_base_seed"]
    stream = _ResumedIndexStream(dataloader._index_sampler, skip, on_positioned, free_iters=int(reused_workers))
    # DataLoader forbids re-assigning these after __init__; on our own copy it is safe.
    object.__setattr__(resumed, "batch_sampler" if dataloader._auto_collation else "sampler", stream)
    object.__setattr__(resumed, "_iterator", None)  # its own workers, never the original's
    if reused_workers:
        # Persistent workers were seeded in an earlier epoch, so this epoch drew no seed: the copy's fresh
        # workers draw theirs from a throwaway generator.
        object.__setattr__(resumed, "generator", torch.Generator())
    if isinstance(resumed, FabricDataLoader):
        resumed._fabric_epoch = epoch_start["fabric_epoch"]
    return resumed


def _hand_over_workers(dataloader: Iterable[Any], resumed: Iterable[Any]) -> None:
    """Give the copy's persistent workers to the original loader, whose next epoch then reuses them.

    A fresh loader would start new workers and draw their seed, which the uninterrupted run did not do.
    """
    workers = getattr(resumed, "_iterator", None)
    if isinstance(dataloader, DataLoader) and dataloader.persistent_workers and workers is not None:
        workers._index_sampler = dataloader._index_sampler
        object.__setattr__(dataloader, "_iterator", workers)


def _check_loadable(value: object, where: str) -> None:
    """Raise unless ``value`` holds only what ``torch.load(weights_only=True)`` reads back."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            _check_loadable(key, where)
            _check_loadable(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for position, item in enumerate(value):
            _check_loadable(item, f"{where}[{position}]")
    elif value is not None and not isinstance(value, (torch.Tensor, int, float, str, bool)):
        raise TypeError(
            f"{where} holds a {type(value).__name__}; a dataset state must hold only tensors, ints, floats, "
            "strings, bools, None, lists, tuples and dicts, so checkpoints load with weights_only=True."
        )
