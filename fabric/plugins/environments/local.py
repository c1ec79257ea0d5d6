"""The default environment: nothing launched us, so Fabric starts the processes on this machine itself."""

from __future__ import annotations

from collections.abc import Mapping

from typing_extensions import override

from fabric.plugins.environments.cluster_environment import ClusterEnvironment, LaunchedLayout
from fabric.utilities.cli_contract import CLI_MARKER
from fabric.utilities.ports import find_free_port

__all__ = ["LocalEnvironment", "find_free_port"]


class LocalEnvironment(ClusterEnvironment):
    """A single machine where Fabric launches the processes, unless a parent already did (``LOCAL_RANK``).

    The strategy decides world size and global rank (:meth:`set_world_size`, :meth:`set_global_rank`);
    the defaults describe one process.
    """

    launcher_name = "the launcher that set LOCAL_RANK and WORLD_SIZE"

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        super().__init__(environ)
        self._world_size = 1
        self._global_rank = 0
        self._free_port: int | None = None

    @property
    @override
    def creates_processes_externally(self) -> bool:
        """``True`` only in processes that Fabric's own launcher started (it sets ``LOCAL_RANK``)."""
        return "LOCAL_RANK" in self._environ

    @property
    @override
    def main_address(self) -> str:
        return self._environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    @override
    def main_port(self) -> int:
        """``MASTER_PORT`` if set, else a free port chosen once per object so repeated calls agree."""
        if "MASTER_PORT" in self._environ:
            return self._int("MASTER_PORT")
        if self._free_port is None:
            self._free_port = find_free_port()
        return self._free_port

    @classmethod
    @override
    def detect(cls, environ: Mapping[str, str] | None = None) -> bool:
        """Always ``True``: this is the fallback when no other environment is detected."""
        return True

    @override
    def world_size(self) -> int:
        """The launcher's ``WORLD_SIZE`` in a process it started (nodes may be uneven), else the strategy's."""
        if self.creates_processes_externally and "WORLD_SIZE" in self._environ:
            return self._int("WORLD_SIZE")
        return self._world_size

    def set_world_size(self, size: int) -> None:
        """Record the number of processes the strategy will start."""
        if size < 1:
            raise ValueError(f"The world size must be at least 1, got {size}.")
        self._world_size = size

    @override
    def global_rank(self) -> int:
        """The launcher's ``RANK`` in a process it started, else the rank the strategy assigned."""
        if self.creates_processes_externally and "RANK" in self._environ:
            return self._int("RANK")
        return self._global_rank

    def set_global_rank(self, rank: int) -> None:
        """Record this process's rank, as assigned by the strategy."""
        if rank < 0:
            raise ValueError(f"The global rank must be non-negative, got {rank}.")
        self._global_rank = rank

    @override
    def local_rank(self) -> int:
        return self._int("LOCAL_RANK", default=0)

    @override
    def local_world_size(self) -> int | None:
        """``LOCAL_WORLD_SIZE`` in a process a launcher started, when it set it."""
        if self.creates_processes_externally and "LOCAL_WORLD_SIZE" in self._environ:
            return self._int("LOCAL_WORLD_SIZE")
        return None

    @override
    def launched_layout(self) -> LaunchedLayout | None:
        """Known when the launcher that set ``LOCAL_RANK`` also set ``WORLD_SIZE`` (``fabric run``, Fabric's own
        launchers, Ray Train, ...)."""
        if not (self.creates_processes_externally and "WORLD_SIZE" in self._environ):
            return None
        launcher = "`fabric run`" if self._environ.get(CLI_MARKER) == "1" else self.launcher_name
        return LaunchedLayout(launcher, self.world_size(), self.local_world_size(), self.launched_num_nodes())

    @override
    def launched_num_nodes(self) -> int | None:
        """``GROUP_WORLD_SIZE`` (torchrun's name, which ``fabric run`` sets too) in a process a launcher started."""
        if self.creates_processes_externally and "GROUP_WORLD_SIZE" in self._environ:
            return self._int("GROUP_WORLD_SIZE")
        return None

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Several nodes that Fabric starts itself need the rendezvous address and port of node 0, or node 0
        would wait forever."""
        if num_nodes > 1 and not self.creates_processes_externally:
            self._check_multi_node(num_nodes)

    def _check_multi_node(self, num_nodes: int) -> None:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in self._environ]
        node_rank = self.node_rank()
        if not missing and 0 <= node_rank < num_nodes:
            return
        problem = (
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set"
            if missing
            else f"NODE_RANK={node_rank} is outside [0, {num_nodes})"
        )
        if "SLURM_JOB_ID" in self._environ:  # an sbatch script or salloc shell: srun starts tasks on every node
            fix = (
                "This is a SLURM allocation but not a job step: run the script under srun "
                f"(`srun --nodes={num_nodes} --ntasks-per-node=<devices> python ...`)."
            )
        else:
            fix = (
                f"On every node set MASTER_ADDR (the host of node 0, reachable from all nodes), the same MASTER_PORT "
                f"and NODE_RANK (0..{num_nodes - 1}), or start the job with "
                f"`fabric run --num-nodes={num_nodes} --main-address=HOST`."
            )
        raise ValueError(
            f"Fabric(num_nodes={num_nodes}) without a cluster environment (SLURM, torchrun, ...) cannot start: "
            f"{problem}, so node 0 would wait forever for nodes that never find it. {fix}"
        )

    @override
    def node_rank(self) -> int:
        """``NODE_RANK``, else ``GROUP_RANK`` (torchrun's name for it), else 0."""
        if "NODE_RANK" in self._environ:
            return self._int("NODE_RANK")
        return self._int("GROUP_RANK", default=0)
