"""``ReplicaGroups``: this group's side of torchft's per-step protocol, in the order a training step needs it.

torchft (the optional ``[ft]`` extra) does the work: its lighthouse forms a quorum of the live groups each step, its
``Manager`` reconfigures the process group across them, averages tensors over the groups taking part, sends a
joining group the weights, optimizer state and step of a healthy one, and decides whether a step commits. This class
only calls it: :meth:`begin_step` before the gradients are needed, :meth:`start_averaging` on them, :meth:`commit`
before the optimizer steps.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from fabric.strategies.fault_tolerant.plan import FaultTolerance
from fabric.utilities.lazy import install_hint

#: How long the lighthouse probe at set-up waits for a connection.
LIGHTHOUSE_PROBE_TIMEOUT = timedelta(seconds=10)


def import_torchft() -> Any:
    """``torchft``, or an ``ImportError`` saying how to install it. Its Rust side logs every quorum and heartbeat
    check at INFO (ten lines a second from a lighthouse): warnings only, unless ``RUST_LOG`` says otherwise."""
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
    except ImportError as error:
        raise ImportError(f"Fault tolerance needs the torchft package: {install_hint('ft', 'torchft')}.") from error
    return torchft


def probe_lighthouse(plan: FaultTolerance) -> None:
    """A ``ConnectionError`` in one line when nothing answers at the lighthouse's address."""
    host, port = plan.lighthouse_host_and_port
    try:
        socket.create_connection((host, port), timeout=LIGHTHOUSE_PROBE_TIMEOUT.total_seconds()).close()
    except OSError as error:
        raise ConnectionError(
            f"The torchft lighthouse at {plan.lighthouse} is unreachable ({error.strerror or error}): start it first "
            "(`fabric lighthouse`) or correct lighthouse= / TORCHFT_LIGHTHOUSE."
        ) from None


class ReplicaGroups:
    """torchft's ``Manager`` for this process: rank ``group_rank`` of ``group_size`` in replica group
    ``plan.replica_group``, whose own rendezvous store is at ``store_address:store_port``; with ``init_sync`` torchft
    makes the groups' states equal at the run's first step."""

    def __init__(
        self,
        plan: FaultTolerance,
        group_rank: int,
        group_size: int,
        store_address: str,
        store_port: int,
        device: torch.device,
        init_sync: bool = True,
    ) -> None:
        torchft = import_torchft()
        if group_rank == 0:  # only rank 0 of a group talks to the lighthouse
            probe_lighthouse(plan)
        process_group = (
            torchft.ProcessGroupNCCL(timeout=plan.timeout)
            if device.type == "cuda"
            else torchft.ProcessGroupGloo(timeout=plan.timeout)
        )
        self._process_group = process_group
        self.plan = plan
        self._device = device
        self._manager = torchft.Manager(
            pg=process_group,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=plan.min_replica_groups,
            use_async_quorum=True,
            timeout=plan.timeout,
            quorum_timeout=plan.quorum_timeout,
            connect_timeout=plan.timeout,
            rank=group_rank,
            world_size=group_size,
            store_addr=store_address,
            store_port=store_port,
            lighthouse_addr=plan.lighthouse,
            replica_id=f"fabric_replica_group_{plan.replica_group}",
            init_sync=init_sync,
        )
        self._step_begun = False
        self._state_names: list[str] = []
        #: The run's committed steps after this group's last commit (0 before its first).
        self.steps_before = 0
        #: Set by :meth:`commit` when this group has just received a peer's state: the step it joined at.
        self.joined_at: int | None = None

    def register_state(self, kind: str, load: Callable[[Any], None], state: Callable[[], Any]) -> None:
        """What a joining group receives from a healthy one (and loads before its first step): ``state()`` there,
        ``load(...)`` here. Registered per object, in set-up order, so both sides name it alike."""
        name = f"{kind}_{sum(existing.startswith(kind) for existing in self._state_names)}"
        self._state_names.append(name)
        self._manager.register_state_dict_fn(name, load, state)

    def begin_step(self) -> None:
        """Ask the lighthouse for this step's quorum (in the background), once per step."""
        if not self._step_begun:
            self._manager.start_quorum()
            self._step_begun = True

    def start_averaging(self, tensors: Sequence[torch.Tensor], copy: bool = False) -> Averaging:
        """Start averaging ``tensors`` over the groups in this step's quorum (one exchange per dtype and device, in the
        background); :meth:`Averaging.wait` gives the averages. Every group starts its exchanges in the same order.
        Tensors that tile one piece of memory (one tensor; FSDP's gradient shards, views of its reduce-scatter's
        output) are averaged in place unless ``copy``, others in one concatenated copy."""
        self.begin_step()
        by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for index, tensor in enumerate(tensors):
            by_kind.setdefault((tensor.dtype, tensor.device), []).append(index)
        exchanges = []
        for indices in by_kind.values():
            span = None if copy else _span([tensors[index] for index in indices])
            flat = torch.cat([tensors[index].reshape(-1) for index in indices]) if span is None else span
            exchanges.append((indices, flat, span is not None, self._manager.allreduce(flat)))
        return Averaging(self, list(tensors), exchanges)

    def agree(self, fingerprint: int) -> bool:
        """Whether every group in this step's quorum holds ``fingerprint`` (an int below 2**32, the same rank's of
        each group): its average over them, exact in float64, is ``fingerprint`` itself."""
        averaged = torch.tensor([float(fingerprint)], dtype=torch.float64, device=self._device)
        self.start_averaging([averaged]).wait()  # one tensor: averaged in place
        return bool(averaged.item() == float(fingerprint))

    def finish_exchange(self, work: Any) -> None:
        """Wait for one exchange. A failed exchange aborts this group's side of it at once: the peers still waiting
        on this group in it (a ring passes data on) then fail now, not after ``timeout``, and join the next quorum
        in time (torchft reconfigures after a failed commit)."""
        work.wait()
        if self._manager.errored() is not None:
            self._process_group.abort()

    def commit(self) -> bool:
        """Whether this step's update may be applied: True on every group of the quorum, or False on all (a group
        failed, or fewer than ``min_replica_groups`` took part). A joining group loads a peer's state here."""
        self.begin_step()
        self._step_begun = False
        committed = bool(self._manager.should_commit())
        steps = self.committed_steps
        self.joined_at = steps - int(committed) if steps > self.steps_before + 1 else None
        self.steps_before = steps
        return committed

    def checkpoint_state(self) -> dict[str, int]:
        """torchft's counts of the run (committed steps and batches), for a checkpoint."""
        return dict(self._manager.state_dict())

    def restore(self, state: dict[str, int]) -> None:
        """Continue the counts of :meth:`checkpoint_state` (before this group's first step of the run)."""
        if self._step_begun:
            raise RuntimeError(
                "A fault-tolerant run loads its checkpoint before its first step: this step's quorum has already "
                "been asked for with the current step count. Call fabric.load(...) before the training loop."
            )
        self._manager.load_state_dict(state)
        self.steps_before = self.committed_steps

    @property
    def committed_steps(self) -> int:
        """Steps committed so far in the run, the same on every group (a joining group receives it)."""
        return int(self._manager.current_step())

    @property
    def participants(self) -> int:
        """How many groups took part in the last quorum."""
        return int(self._manager.num_participants())

    def shutdown(self) -> None:
        self._manager.shutdown(wait=False)


class Averaging:
    """Exchanges :meth:`ReplicaGroups.start_averaging` started, one per dtype and device of its tensors."""

    def __init__(
        self,
        groups: ReplicaGroups,
        tensors: list[torch.Tensor],
        exchanges: list[tuple[list[int], torch.Tensor, bool, Any]],
    ) -> None:
        self._groups = groups
        self._tensors = tensors
        self._exchanges = exchanges

    def wait(self) -> list[torch.Tensor]:
        """The tensors averaged, in order: themselves where exchanged in place, else views of the exchanged copies,
        so that a caller may take them as they are rather than copy them back (a joining group contributes zeros and
        receives the average). A failed exchange is not raised: it makes :meth:`ReplicaGroups.commit` return False on
        every group."""
        averages = list(self._tensors)
        for indices, flat, in_place, work in self._exchanges:
            self._groups.finish_exchange(work)
            if in_place:
                continue
            parts = torch.split(flat, [self._tensors[index].numel() for index in indices])
            for index, part in zip(indices, parts, strict=True):
                averages[index] = part.view_as(self._tensors[index])
        return averages


def _span(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One flat view of the memory ``tensors`` cover when they are contiguous and tile one piece of one storage
    without gap or overlap (in any order); else None."""
    storage = tensors[0].untyped_storage().data_ptr()
    if any(not t.is_contiguous() or t.untyped_storage().data_ptr() != storage for t in tensors):
        return None
    start = end = min(t.storage_offset() for t in tensors)
    for offset, numel in sorted((t.storage_offset(), t.numel()) for t in tensors):
        if offset != end:
            return None
        end += numel
    return torch.as_strided(tensors[0], (end - start,), (1,), start)
