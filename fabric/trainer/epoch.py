"""Where training stands in the train dataloader's epoch: the :class:`EpochCursor` the Trainer's loop draws batches
from.

It keeps the current epoch's batch iterator (across ``fit()`` calls that end mid-epoch), what rebuilds that epoch's
order (taken right before its first batch), and a checkpoint's data position to resume from. It answers the position
a checkpoint saves (:meth:`EpochCursor.position`) and the one a fault-tolerant replica group joining the run
continues from (:meth:`EpochCursor.position_after_this_batch`). How a position is recorded and replayed is
:mod:`fabric.trainer.checkpoint.dataloader_position` (same world size) and
:mod:`fabric.trainer.checkpoint.sample_position` (another world or batch size).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from fabric.trainer.checkpoint.dataloader_position import (
    EpochStart,
    capture_epoch_start,
    capture_loader_state,
    epoch_start_record,
    keeps_own_position,
    resume_iterator,
)
from fabric.trainer.checkpoint.sample_position import (
    EpochPlan,
    check_resumable,
    count_untrained,
    layout_change,
    planned_epoch,
    resumed_plan,
    samples_record,
)
from fabric.trainer.checkpoint.trainer_state import DataPosition
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State, require_fabric
from fabric.utilities.rank_zero import rank_zero_warn


class EpochCursor:
    """The Trainer's place in the current epoch of ``state.dataloader``; ``run_event`` fires ``EPOCH_START``."""

    def __init__(self, state: State, run_event: Callable[[Event], None]) -> None:
        self._state = state
        self._run_event = run_event
        self.forget()

    def forget(self) -> None:
        """No epoch in progress: the next one starts afresh, where the clock is (or a loaded checkpoint was)."""
        #: The current epoch's batches; None: the next batch starts an epoch (:meth:`begin`).
        self.batches: Iterator[Any] | None = None
        #: The epoch ends when the loader runs out, not at ``dataloader_len`` (a loader resumed on another share).
        self.ends_with_loader = False
        #: What rebuilds the current epoch's batch order: taken before its first fetch (:meth:`mark_start`).
        self.start: EpochStart | dict[str, Any] | None = None
        self._resume_position: DataPosition | None = None
        #: The plan of an epoch resumed by samples, and the batches of the epoch counted before it began.
        self._plan: tuple[EpochPlan, int] | None = None

    def begin(self, dataloader: Iterable[Any]) -> Iterator[Any]:
        """The epoch's batch iterator (kept in :attr:`batches`): fresh, after ``EPOCH_START``, or positioned where a
        checkpoint (or a peer replica group) left off."""
        self.batches = self._iterator(dataloader)
        return self.batches

    def mark_start(self, dataloader: Iterable[Any]) -> None:
        """Take what rebuilds this epoch's order: the loop calls this right before the epoch's first fetch (while
        :attr:`start` is None), after any ``BEFORE_DATALOADER`` draws."""
        self.start = EpochStart.take(dataloader)

    def end(self) -> None:
        """The epoch ran to its end: the next batch begins another."""
        self.batches = None
        self.ends_with_loader = False
        self._plan = None

    def _iterator(self, dataloader: Iterable[Any]) -> Iterator[Any]:
        position, self._resume_position = self._resume_position, None
        shares = self._data_shares()
        if position is not None and position.loader_state is not None and keeps_own_position(dataloader):
            dataloader.load_state_dict(position.loader_state)  # type: ignore[attr-defined]
            if position.batches_done == 0:
                self._run_event(Event.EPOCH_START)
            self.start = None
            self.ends_with_loader = position.batches_done > 0
            return iter(dataloader)  # the loader continues where it was, on any number of ranks
        if position is not None and position.epoch_start is not None:
            if position.batches_done and layout_change(position, dataloader, shares):
                return self._resume_by_samples(dataloader, position)
            # At an epoch boundary with other data shares the loader is sharded differently: start it afresh.
            same_shares = position.data_shares == shares
            self.start = position.epoch_start if same_shares else capture_epoch_start(dataloader)
            if position.batches_done == 0:
                self._run_event(Event.EPOCH_START)
            return resume_iterator(dataloader, self.start, position.batches_done)
        self._run_event(Event.EPOCH_START)
        self.start = None  # taken right before the first fetch (mark_start)
        return iter(dataloader)

    def _resume_by_samples(self, dataloader: Iterable[Any], position: DataPosition) -> Iterator[Any]:
        """The rest of an epoch saved with another world size or batch size: the samples it had not trained yet,
        dealt to this run's ranks (:mod:`~fabric.trainer.checkpoint.sample_position`)."""
        assert position.samples is not None and position.epoch_start is not None  # checked when it was loaded
        shares, share = require_fabric(self._state).strategy.data_parallel_shard
        rank_zero_warn(
            f"Resuming mid-epoch with {layout_change(position, dataloader, shares)}: the "
            f"{count_untrained(position.samples)} samples of the epoch not trained yet are dealt to this run's "
            "data shares, each once; their order and the random numbers differ from an uninterrupted run's."
        )
        plan = resumed_plan(position.samples, dataloader, shares)
        self._plan = (plan, position.batches_done)
        self.start = position.epoch_start
        self.ends_with_loader = True
        return planned_epoch(dataloader, plan.batches_of(share), position.epoch_start)

    def position(self) -> DataPosition:
        """Where the data stands now, for a checkpoint: the epoch's order and how far into it training is."""
        timestamp, loader = self._state.timestamp, self._state.dataloader
        shares = self._data_shares()
        batches_done = int(timestamp.batch_in_epoch)
        epoch_start = self.start if batches_done else (capture_epoch_start(loader) if loader else None)
        epoch_start = None if epoch_start is None else epoch_start_record(epoch_start)
        loader_state = capture_loader_state(loader) if keeps_own_position(loader) else None
        samples = None
        if batches_done and loader_state is None and loader is not None:
            samples = samples_record(loader, shares, batches_done, self._plan)
        samples_done = int(timestamp.sample_in_epoch)
        return DataPosition(epoch_start, batches_done, samples_done, shares, loader_state, samples)

    def position_after_this_batch(self) -> DataPosition:
        """Where the data stands once the batch in flight is trained: what a replica group joining the run at this
        step continues its own share from (fault tolerance; asked for during the step)."""
        timestamp, loader = self._state.timestamp, self._state.dataloader
        if self.start is None or loader is None:
            raise RuntimeError("A replica group asked for the data position outside a training step.")
        loader_state = capture_loader_state(loader) if keeps_own_position(loader) else None
        batches_done, samples_done = int(timestamp.batch_in_epoch) + 1, int(timestamp.sample_in_epoch)
        return DataPosition(
            epoch_start_record(self.start), batches_done, samples_done, self._data_shares(), loader_state
        )

    def resume_at(self, position: DataPosition) -> None:
        """Continue from a checkpoint's (or a peer's) data position, checked against this run's loader first; the
        next batch begins the resumed epoch."""
        loader = self._state.dataloader
        if loader is not None and position.batches_done and position.loader_state is None:
            check_resumable(position, loader, self._data_shares())
        self._resume_position = position
        self.batches = None

    def _data_shares(self) -> int:
        """How many ranks split the train data (world size, or the data-parallel ranks under tensor/pipeline
        parallelism): what a position's sharding depends on."""
        return require_fabric(self._state).strategy.data_parallel_shard[0]
