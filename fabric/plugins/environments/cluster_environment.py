"""The cluster-environment interface: where this process sits in a job, as told by the launcher's variables.

A launcher or scheduler (torchrun, SLURM, MPI, ...) describes the job through environment variables. A
cluster environment reads them so that strategies never have to know which launcher was used.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class LaunchedLayout:
    """What an external launcher started: the whole world, and how many of its processes run on this node."""

    #: The launcher in words, for messages ("SLURM's srun", "torchrun").
    launcher: str
    world_size: int
    #: ``None`` when the launcher does not say how many processes it started on this node.
    local_world_size: int | None
    #: How many nodes the launcher started processes on; ``None`` when it does not say. Nodes may differ in size.
    num_nodes: int | None = None

    def describe(self) -> str:
        on_this_node = "" if self.local_world_size is None else f", {self.local_world_size} on this node"
        on_nodes = f" on {self.num_nodes} nodes" if self.num_nodes is not None and self.num_nodes > 1 else ""
        processes = "process" if self.world_size == 1 else "processes"
        return f"{self.launcher} started {self.world_size} {processes}{on_nodes}{on_this_node}"


class ClusterEnvironment(ABC):
    """Answers rank, size and rendezvous questions from one launcher's environment variables.

    Every answer is read from :attr:`environ` when it is asked for, never cached at construction, so an
    environment created early still sees variables set later. ``environ`` defaults to the live
    :data:`os.environ`; passing a mapping makes the environment describe that mapping instead (handy in
    tests and tools that inspect another process's environment).
    """

    #: The launcher in words, for messages; subclasses name theirs.
    launcher_name: ClassVar[str] = "the launcher"

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._environ: Mapping[str, str] = os.environ if environ is None else environ

    def __getstate__(self) -> dict[str, Any]:
        # The live os.environ cannot be pickled (spawned ranks get a copy of this object); a process
        # that unpickles it reads its own live environment instead.
        state = self.__dict__.copy()
        if state["_environ"] is os.environ:
            state["_environ"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if state["_environ"] is None:
            state["_environ"] = os.environ
        self.__dict__.update(state)

    @property
    def environ(self) -> Mapping[str, str]:
        """The variables this environment reads."""
        return self._environ

    @property
    @abstractmethod
    def creates_processes_externally(self) -> bool:
        """Whether a launcher already started every process; if ``False``, Fabric must start them itself."""

    @property
    @abstractmethod
    def main_address(self) -> str:
        """Host of the rank-0 process, where the other processes meet to form the process group."""

    @property
    @abstractmethod
    def main_port(self) -> int:
        """Port on :attr:`main_address` used for that rendezvous; every process must agree on it."""

    @classmethod
    @abstractmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> bool:
        """Whether this environment's variables are present in ``environ`` (default: :data:`os.environ`)."""

    @abstractmethod
    def world_size(self) -> int:
        """Number of processes in the whole job."""

    @abstractmethod
    def global_rank(self) -> int:
        """Index of this process among all processes of the job."""

    @abstractmethod
    def local_rank(self) -> int:
        """Index of this process among the processes on its node; usually its device index."""

    @abstractmethod
    def node_rank(self) -> int:
        """Index of this process's node among the nodes of the job."""

    def local_world_size(self) -> int | None:
        """How many processes the launcher started on this node; ``None`` when it does not say."""
        return None

    def launched_num_nodes(self) -> int | None:
        """How many nodes the launcher started processes on; ``None`` when it does not say."""
        return None

    def launched_layout(self) -> LaunchedLayout | None:
        """What the launcher started, when one did (:attr:`creates_processes_externally`); ``None`` when Fabric
        starts the processes itself. Fabric follows it when ``devices``/``num_nodes`` are not given, and refuses
        arguments that disagree with it (the connector), so no process silently runs as a world of its own."""
        if not self.creates_processes_externally:
            return None
        return LaunchedLayout(self.launcher_name, self.world_size(), self.local_world_size(), self.launched_num_nodes())

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Check what only this environment can about ``devices`` and ``num_nodes`` (e.g. the rendezvous
        variables several nodes need). Agreement with the launcher's layout is checked for every environment
        by the connector, from :meth:`launched_layout`; the default checks nothing more."""
        return  # deliberately a no-op default, not an abstract method

    def teardown(self) -> None:
        """Undo anything this environment changed in the process; the default changed nothing."""
        return  # deliberately a no-op default, not an abstract method

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # --- helpers for subclasses ----------------------------------------------------------------------

    @staticmethod
    def _resolve_environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
        """``environ``, or the live :data:`os.environ` when it is ``None`` (for :meth:`detect`)."""
        return os.environ if environ is None else environ

    def _require(self, name: str, hint: str = "") -> str:
        """The value of variable ``name``; a clear error (with ``hint``) if it is not set."""
        value = self._environ.get(name)
        if value is None:
            message = f"{type(self).__name__} needs the environment variable {name}, but it is not set."
            raise ValueError(f"{message} {hint}".rstrip())
        return value

    def _int(self, name: str, default: int | None = None, hint: str = "") -> int:
        """Variable ``name`` as an integer; ``default`` if it is unset (an error if there is no default)."""
        if default is not None and name not in self._environ:
            return default
        value = self._require(name, hint)
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"The environment variable {name}={value!r} must be an integer.") from None
