"""Saves that do not stall training: a CPU snapshot taken now, written on a background thread.

At most one save is in flight: the next one (and any load) first waits for it. Its error is raised
there, again from the returned future, and reported on standard error the moment it happens. The thread
is not a daemon: a script that ends while a save is being written exits once the checkpoint is complete,
and if that last save failed the process ends with code 1, never 0 (a scheduler would count the job as a
success with no checkpoint). The write itself is the synchronous one (the same temporary-then-rename and
completeness checks), so a background save is as atomic as any other.

The snapshot copies every tensor into memory the save owns and deep-copies everything else in the state
(NumPy arrays, lists, user objects), so that nothing changed after ``save`` returns reaches the file; an
object that cannot be copied is refused there, naming its entry.

Where one rank writes for all (DDP), :func:`written_by_rank_zero` makes every rank's future wait for that
write and fail with it, so a rank that loads after its future completed reads the new checkpoint.
"""

from __future__ import annotations

import copy
import functools
import sys
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from fabric.utilities.dtensor import laid_out_like
from fabric.utilities.exceptions import CheckpointError
from fabric.utilities.processes.exit import exit_process, register_cleanup

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class BackgroundSaves:
    """Runs one checkpoint write at a time on a background thread."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        #: The previous snapshot's tensors, in the order they came: memory the next one reuses.
        self._buffers: list[torch.Tensor] = []

    def __reduce__(self) -> tuple[type[BackgroundSaves], tuple[()]]:
        """A spawned rank gets a copy with nothing in flight (threads and buffers stay in this process)."""
        return (BackgroundSaves, ())

    def submit(self, write: Callable[[], None], description: str) -> Future[None]:
        """Wait for the previous save (raising its error), then start ``write`` in the background."""
        self.wait()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fabric-checkpoint")
            register_cleanup(functools.partial(_at_exit, weakref.ref(self)))  # not kept alive (snapshot memory) for it
        pending = self._executor.submit(_reporting_failure, write, description)
        self._pending = pending
        return pending

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; raise the error it had."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def snapshot(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state`` that nothing the caller does later can change: its tensors in CPU memory this
        save owns (in dicts, lists, tuples, ...), everything else deep-copied.

        Buffers are reused from one save to the next, in the order the tensors come (the previous save is
        finished by then), which spares the allocation and first touch of fresh memory.
        """
        self.wait()
        previous, self._buffers = self._buffers, []
        copies: dict[int, Any] = {}  # deepcopy's memo: each tensor found maps to its snapshot

        def copy_tensor(tensor: torch.Tensor) -> torch.Tensor:
            copied = copies[id(tensor)] = self._copy(tensor, previous)
            return copied

        apply_to_collection(state, torch.Tensor, copy_tensor)
        snapshot = {}
        for key, value in state.items():
            try:
                snapshot[key] = copy.deepcopy(value, copies)
            except Exception as error:
                raise CheckpointError(
                    f"async_save=True writes a copy of the state taken now, and state[{key!r}] (a "
                    f"{type(value).__name__}) cannot be copied: {type(error).__name__}: {error}. Save it without "
                    "async_save, or leave that object out of the state."
                ) from error
        return snapshot

    def _copy(self, tensor: torch.Tensor, previous: list[torch.Tensor]) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(tensor, DTensor):  # a shard: copy the local part, keep the layout
            return laid_out_like(self._copy(tensor.to_local(), previous), tensor)
        source = tensor.detach()
        position = len(self._buffers)
        buffer = previous[position] if position < len(previous) else None
        if buffer is None or buffer.dtype != source.dtype or buffer.shape != source.shape or not _plain(source):
            buffer = torch.empty_like(source, device="cpu")
        buffer.copy_(source)
        self._buffers.append(buffer)
        return buffer


def _plain(tensor: torch.Tensor) -> bool:
    """A dense, strided tensor whose memory can be reused (not sparse, quantized or a tensor subclass)."""
    return type(tensor) is torch.Tensor and tensor.layout == torch.strided and not tensor.is_quantized


def _at_exit(saves: weakref.ref[BackgroundSaves]) -> None:
    """At exit (the save thread has finished by then): a last save that failed, and that no later save or load
    raised, ends the process with code 1 (its error was printed when it happened)."""
    alive = saves()
    if alive is None:
        return
    try:
        alive.wait()
    except BaseException:
        print("fabric: exiting with code 1: the last background save failed (see above).", file=sys.stderr)
        exit_process(1, run_registered_cleanups=True)


def written_by_rank_zero(write: Callable[[], None] | None, group: ProcessGroup, description: str) -> None:
    """On every rank's save thread: rank 0 runs ``write`` (the others pass ``None``), then tells every rank on
    ``group`` how it ended, so that each rank's save completes only once the checkpoint is complete, and fails
    if it failed. ``group`` is a process group of the background saves alone (never training's)."""
    import torch.distributed as dist

    failure: BaseException | None = None
    if write is not None:
        try:
            write()
        except BaseException as error:
            failure = error
    outcome = [None if failure is None else f"{type(failure).__name__}: {failure}"]
    dist.broadcast_object_list(outcome, src=0, group=group)
    if failure is not None:
        raise failure
    if outcome[0] is not None:
        raise CheckpointError(f"rank 0, which writes {description}, failed: {outcome[0]}")


def written_in_parts(
    write_part: Callable[[], None], publish: Callable[[], None] | None, group: ProcessGroup | None, description: str
) -> None:
    """On every rank's save thread: each rank writes its part, then, once every part is written, rank 0 runs
    ``publish`` (the others pass ``None``) and tells every rank how it ended (:func:`written_by_rank_zero`). A part
    that failed on any rank fails every rank's save, naming it, and nothing is published. ``group`` is the background
    saves' own (None with one process)."""
    if group is None:
        write_part()
        if publish is not None:
            publish()
        return
    import torch.distributed as dist

    failure: BaseException | None = None
    try:
        write_part()
    except BaseException as error:
        failure = error
    outcomes: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, None if failure is None else f"{type(failure).__name__}: {failure}", group=group)
    if failure is not None:
        raise failure
    failed = [(rank, outcome) for rank, outcome in enumerate(outcomes) if outcome is not None]
    if failed:
        rank, outcome = failed[0]
        raise CheckpointError(f"rank {rank}, which writes its part of {description}, failed: {outcome}")
    written_by_rank_zero(publish, group, description)


def finished() -> Future[None]:
    """The future of a save that is already complete (a synchronous one, or a rank with nothing to write)."""
    done: Future[None] = Future()
    done.set_result(None)
    return done


def _reporting_failure(write: Callable[[], None], description: str) -> None:
    """Run ``write``; if it fails, say so on standard error before the future completes, then raise."""
    try:
        write()
    except BaseException as error:
        print(
            f"fabric: the background save of {description} failed: {type(error).__name__}: {error} "
            "(raised again at the next save or load)",
            file=sys.stderr,
            flush=True,
        )
        raise
