"""The Trainer's own part of a checkpoint: clock, schedules, algorithm and callback states, data position.

Model, optimizers and the precision plugin's scaler are saved by Fabric next to this entry; RNG
states of every rank are gathered by the saver into a plain ``"rng"`` entry. Everything here is made
of numbers, strings, lists, dicts and tensors, so ``torch.load(weights_only=True)`` reads it without
allow-listing any class.

Algorithms and callbacks are keyed by a unique name: the class name, with ``-1``, ``-2`` ... for the
second and later instances of one class, in the order given to the Trainer. A saved non-empty state
needs its object in the loading Trainer; objects the checkpoint has no state for keep theirs. Loading is all or
nothing: every part is validated first, and if applying one part still fails, the parts already
applied are put back before the error propagates.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fabric.trainer.core.state import State
from fabric.trainer.core.time import Timestamp

#: Sections of the trainer entry that ``load_ignore_keys`` may name (plus ``"optimizers"`` and ``"rng"``,
#: which live in their own checkpoint entries).
SECTIONS = ("timestamp", "schedulers", "algorithms", "callbacks", "dataloader", "microbatch_size")


_EMPTY_SECTIONS: dict[str, Any] = {"schedulers": [], "algorithms": {}, "callbacks": {}}


def to_blob(value: object) -> bytes:
    """``value`` serialized whole (tensors, ints, strings, lists and dicts: it loads with ``weights_only=True``).

    For checkpoint entries whose shape differs between a checkpoint and the live state it loads into: a sharded
    (DCP) load fills the structure of the live state, so nested values that come and go cannot be loaded as such.
    """
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def from_blob(blob: object, entry: str) -> Any:
    """What :func:`to_blob` serialized (loaded with ``weights_only=True``); ``entry`` names it in the error."""
    if not isinstance(blob, bytes):
        raise ValueError(f"{entry} holds a {type(blob).__name__} where a serialized value belongs")
    return torch.load(io.BytesIO(blob), weights_only=True)


def _from_optional_blob(blob: object) -> Any:
    """A dataloader blob; None where a checkpoint written before these were blobs has no such entry."""
    return None if blob is None else from_blob(blob, "the trainer's dataloader entry")


def unique_names(objects: Iterable[object]) -> list[str]:
    """``["EMA", "EMA-1", "SpeedMonitor"]``: class names, numbered from the second instance of a class on."""
    seen: dict[str, int] = {}
    names = []
    for obj in objects:
        name = type(obj).__name__
        count = seen.get(name, 0)
        seen[name] = count + 1
        names.append(name if count == 0 else f"{name}-{count}")
    return names


@dataclass
class DataPosition:
    """Where in the train dataloader a checkpoint was taken: the epoch's start state and batches done."""

    epoch_start: dict[str, Any] | None
    batches_done: int
    #: Samples of the epoch done (all ranks); what survives a change of world size.
    samples_done: int = 0
    #: How many ranks split the data (``strategy.data_parallel_shard``): under tensor or pipeline parallelism the
    #: data-parallel ranks, not the world size. Saved under its first name, ``world_size``.
    data_shares: int = 1
    #: The ``state_dict()`` of a loader that keeps its own position (a streaming loader), else None.
    loader_state: Any = None
    #: Mid-epoch, what a resume with another world size or batch size needs (``sample_position.samples_record``).
    samples: dict[str, Any] | None = None


class TrainerCheckpointState:
    """A stateful view of the Trainer for ``fabric.save``/``fabric.load``.

    ``data_position`` returns the current :class:`DataPosition`; ``on_load_position`` receives the one
    read from a checkpoint (the Trainer then rebuilds its epoch iterator from it).
    """

    def __init__(
        self,
        state: State,
        schedulers: Sequence[Any],
        observers: Sequence[Any],
        data_position: Callable[[], DataPosition],
        on_load_position: Callable[[DataPosition], None],
        ignore: Collection[str] = (),
    ) -> None:
        unknown = sorted(set(ignore) - set(SECTIONS))
        if unknown:
            raise ValueError(f"Cannot ignore {unknown}: the trainer's checkpoint sections are {list(SECTIONS)}.")
        self.state = state
        self.schedulers = list(schedulers)
        self.observers = dict(zip(unique_names(observers), observers, strict=True))
        self.algorithms = dict(zip(unique_names(state.algorithms), state.algorithms, strict=True))
        self.data_position = data_position
        self.on_load_position = on_load_position
        self.ignore = frozenset(ignore)

    def state_dict(self) -> dict[str, Any]:
        position = self.data_position()
        return {
            "timestamp": self.state.timestamp.state_dict(),
            "schedulers": [scheduler.state_dict() for scheduler in self.schedulers],
            "algorithms": {name: algorithm.state_dict() for name, algorithm in self.algorithms.items()},
            "callbacks": {name: observer.state_dict() for name, observer in self.observers.items()},
            "dataloader": {
                "epoch_start": position.epoch_start,
                "batches_done": position.batches_done,
                "samples_done": position.samples_done,
                "world_size": position.data_shares,
                # Blobs: their shape differs between a checkpoint and the trainer it loads into (a sharded, DCP,
                # load fills the structure of the live state, so nested values that come and go cannot be loaded).
                "loader_state": to_blob(position.loader_state),
                "samples": to_blob(position.samples),
            },
            "microbatch_size": self.state.device_train_microbatch_size,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        sections = [name for name in SECTIONS if name not in self.ignore]
        # Sharded (DCP) checkpoints drop empty containers: an absent list or dict section was empty.
        state_dict = {**{name: empty for name, empty in _EMPTY_SECTIONS.items()}, **state_dict}
        missing = [name for name in sections if name not in state_dict]
        if missing:
            raise ValueError(f"the trainer entry has no {missing}; it holds {sorted(state_dict)}.")
        timestamp = Timestamp.from_state_dict(state_dict["timestamp"]) if "timestamp" in sections else None
        self._check_names("schedulers", len(self.schedulers), state_dict, sections)
        self._check_names("algorithms", self.algorithms, state_dict, sections)
        self._check_names("callbacks", self.observers, state_dict, sections)
        backups = [(obj, obj.state_dict()) for obj in self._stateful(sections)]
        try:
            if "schedulers" in sections:
                for scheduler, saved in zip(self.schedulers, state_dict["schedulers"], strict=True):
                    scheduler.load_state_dict(saved)
            for section, objects in (("algorithms", self.algorithms), ("callbacks", self.observers)):
                if section in sections:
                    for name, obj in objects.items():
                        if state_dict[section].get(name):
                            obj.load_state_dict(state_dict[section][name])
        except Exception:
            for obj, backup in backups:
                obj.load_state_dict(backup)
            raise
        if timestamp is not None:
            self.state.timestamp = timestamp
        if "microbatch_size" in sections:
            self.state.device_train_microbatch_size = state_dict["microbatch_size"]
        if "dataloader" in sections:
            saved = state_dict["dataloader"]
            self.on_load_position(
                DataPosition(
                    saved["epoch_start"],
                    int(saved["batches_done"]),
                    int(saved.get("samples_done", 0)),
                    int(saved.get("world_size", 1)),
                    _from_optional_blob(saved.get("loader_state")),
                    _from_optional_blob(saved.get("samples")),
                )
            )

    def _stateful(self, sections: Sequence[str]) -> list[Any]:
        objects: list[Any] = []
        if "schedulers" in sections:
            objects += self.schedulers
        if "algorithms" in sections:
            objects += self.algorithms.values()
        if "callbacks" in sections:
            objects += self.observers.values()
        return objects

    @staticmethod
    def _check_names(
        section: str, expected: int | Collection[str], state_dict: Mapping[str, Any], sections: Sequence[str]
    ) -> None:
        """The checkpoint must hold exactly this trainer's schedulers/algorithms/callbacks (by count or name)."""
        if section not in sections:
            return
        saved = state_dict[section]
        if isinstance(expected, int):
            if len(saved) != expected:
                raise ValueError(
                    f"the checkpoint has {len(saved)} scheduler state(s) and this trainer {expected}; "
                    "pass load_ignore_keys=['schedulers'] to skip them."
                )
            return
        orphans = sorted(name for name, state in saved.items() if state and name not in expected)
        if orphans:
            raise ValueError(
                f"the checkpoint holds state for {section} {orphans}, which this trainer does not have (it has "
                f"{sorted(expected)}); pass load_ignore_keys=[{section!r}] to skip them."
            )
