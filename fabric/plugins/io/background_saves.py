"""Saves that do not stall training: a CPU snapshot taken now, written on a background thread.

At most one save is in flight: the next one (and any load) first waits for it. Its error is raised
there, again from the returned future, and reported on standard error the moment it happens, so a job
that never saves again still hears of it. The thread is not a daemon: a script that ends while a save
is being written exits once the checkpoint is complete. The write itself is the synchronous one (the
same temporary-then-rename and completeness checks), so a background save is as atomic as any other.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection


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
        pending = self._executor.submit(_reporting_failure, write, description)
        self._pending = pending
        return pending

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; raise the error it had."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def snapshot(self, value: Any) -> Any:
        """A copy of ``value`` whose tensors are in CPU memory this save owns (in dicts, lists, tuples, ...).

        Buffers are reused from one save to the next, in the order the tensors come (the previous save is
        finished by then), which spares the allocation and first touch of fresh memory.
        """
        self.wait()
        previous, self._buffers = self._buffers, []
        return apply_to_collection(value, torch.Tensor, self._copy, previous)

    def _copy(self, tensor: torch.Tensor, previous: list[torch.Tensor]) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(tensor, DTensor):  # a shard: copy the local part, keep the layout
            local = self._copy(tensor.to_local(), previous)
            return DTensor.from_local(
                local,
                tensor.device_mesh,
                tensor.placements,
                run_check=False,
                shape=tensor.shape,
                stride=tensor.stride(),
            )
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
