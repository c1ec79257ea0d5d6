"""Processes started by ``torchrun`` (torch.distributed.elastic)."""

from __future__ import annotations

from collections.abc import Mapping

from typing_extensions import override

from fabric.plugins.environments.cluster_environment import ClusterEnvironment

_DETECT_VARIABLES = ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


class TorchElasticEnvironment(ClusterEnvironment):
    """``torchrun`` started every process and exported its rank, its node and the rendezvous address."""

    launcher_name = "torchrun"

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        return self._require("MASTER_ADDR")

    @property
    @override
    def main_port(self) -> int:
        return self._int("MASTER_PORT")

    @classmethod
    @override
    def detect(cls, environ: Mapping[str, str] | None = None) -> bool:
        """All of ``RANK``, ``GROUP_RANK``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are set, as torchrun does."""
        environ = cls._resolve_environ(environ)
        return all(name in environ for name in _DETECT_VARIABLES)

    @override
    def world_size(self) -> int:
        return self._int("WORLD_SIZE")

    @override
    def global_rank(self) -> int:
        return self._int("RANK")

    @override
    def local_rank(self) -> int:
        return self._int("LOCAL_RANK")

    @override
    def node_rank(self) -> int:
        return self._int("GROUP_RANK")

    @override
    def local_world_size(self) -> int | None:
        return self._int("LOCAL_WORLD_SIZE")

    @override
    def launched_num_nodes(self) -> int | None:
        """``GROUP_WORLD_SIZE``: the nodes (agents) of this round of the rendezvous."""
        return self._int("GROUP_WORLD_SIZE") if "GROUP_WORLD_SIZE" in self._environ else None
