"""Preemption: on SIGTERM, finish the current batch, save a checkpoint, and exit with a distinct code.

Schedulers (SLURM, Kubernetes, spot instances) send SIGTERM before killing a job. The handler only
sets a flag; the Trainer checks it at every batch boundary (agreeing across ranks, since signals reach
ranks at different moments), saves, and raises :class:`TrainingPreempted`, a ``SystemExit`` with code
:data:`PREEMPTED_EXIT_CODE`, so a wrapper script can tell "preempted, resume me" from success or a crash.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

import torch

from fabric.utilities.exit_codes import PREEMPTED_EXIT_CODE

if TYPE_CHECKING:
    from fabric.fabric import Fabric

__all__ = ["PREEMPTED_EXIT_CODE", "PreemptionWatch", "TrainingPreempted"]


class TrainingPreempted(SystemExit):
    """Raised by ``fit()`` after the preemption checkpoint is saved."""

    def __init__(self, checkpoint: str | None) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        saved = f"checkpoint saved to {self.checkpoint}" if self.checkpoint else "no checkpoint saved"
        return f"Training stopped on SIGTERM ({saved}); exit code {PREEMPTED_EXIT_CODE}."


class PreemptionWatch:
    """Within ``with``: SIGTERM sets :attr:`requested` instead of killing the process (main thread only)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def requested_anywhere(self, fabric: Fabric) -> bool:
        """Whether any rank received SIGTERM; every rank gets the same answer (one small all-reduce)."""
        if fabric.world_size == 1:
            return self.requested
        flag = torch.tensor(float(self.requested), device=fabric.device)
        return bool(fabric.all_reduce(flag, reduce_op="max").item())
