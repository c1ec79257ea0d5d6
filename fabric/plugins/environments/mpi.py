"""Processes started by ``mpirun``/``mpiexec`` (OpenMPI, MPICH or Intel MPI), read without mpi4py."""

from __future__ import annotations

from collections.abc import Mapping

from typing_extensions import override

from fabric.plugins.environments.cluster_environment import ClusterEnvironment

#: Rendezvous port when ``MASTER_PORT`` is not set (the same default as torchrun).
DEFAULT_MPI_PORT = 29500


class MPIEnvironment(ClusterEnvironment):
    """An MPI launcher started every process; its variables give the ranks.

    OpenMPI exports ``OMPI_COMM_WORLD_*``; MPICH and Intel MPI export ``PMI_SIZE``/``PMI_RANK`` and
    ``MPI_LOCALRANKID``/``MPI_LOCALNRANKS``. OpenMPI's variables win when both are present. MPI has no
    notion of a TCP rendezvous, so the user exports ``MASTER_ADDR`` (and optionally ``MASTER_PORT``).
    """

    launcher_name = "mpirun"

    @property
    def _is_openmpi(self) -> bool:
        return "OMPI_COMM_WORLD_SIZE" in self._environ

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        return self._require(
            "MASTER_ADDR",
            "MPI provides no rendezvous address: export MASTER_ADDR=<host of rank 0> (for example with"
            " `mpirun -x MASTER_ADDR=...` or in the job script) before launching.",
        )

    @property
    @override
    def main_port(self) -> int:
        return self._int("MASTER_PORT", default=DEFAULT_MPI_PORT)

    @classmethod
    @override
    def detect(cls, environ: Mapping[str, str] | None = None) -> bool:
        """OpenMPI's or MPICH/Intel MPI's world size and rank variables are set."""
        environ = cls._resolve_environ(environ)
        openmpi = "OMPI_COMM_WORLD_SIZE" in environ and "OMPI_COMM_WORLD_RANK" in environ
        return openmpi or ("PMI_SIZE" in environ and "PMI_RANK" in environ)

    @override
    def world_size(self) -> int:
        return self._int("OMPI_COMM_WORLD_SIZE" if self._is_openmpi else "PMI_SIZE")

    @override
    def global_rank(self) -> int:
        return self._int("OMPI_COMM_WORLD_RANK" if self._is_openmpi else "PMI_RANK")

    @override
    def local_rank(self) -> int:
        return self._int("OMPI_COMM_WORLD_LOCAL_RANK" if self._is_openmpi else "MPI_LOCALRANKID")

    @override
    def local_world_size(self) -> int | None:
        return self._int("OMPI_COMM_WORLD_LOCAL_SIZE" if self._is_openmpi else "MPI_LOCALNRANKS")

    @override
    def node_rank(self) -> int:
        """``global_rank // processes per node``: MPI exports no node index.

        (OpenMPI's ``OMPI_COMM_WORLD_NODE_RANK`` is the rank *within* the node, not the node's index.) The
        derivation assumes the same number of processes on every node, placed by node (MPI's default
        ``--map-by slot``/block placement).
        """
        local_size = self.local_world_size() or 0
        if local_size < 1:
            raise ValueError(f"MPI reports {local_size} processes on this node; cannot derive the node rank.")
        return self.global_rank() // local_size
