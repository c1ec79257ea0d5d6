"""Processes started by ``jsrun`` in an IBM Spectrum LSF job (e.g. on Summit-like machines)."""

from __future__ import annotations

import socket
from collections.abc import Mapping

from typing_extensions import override

from fabric.plugins.environments.cluster_environment import ClusterEnvironment

_DETECT_VARIABLES = (
    "LSB_JOBID",
    "LSB_DJOB_RANKFILE",
    "JSM_NAMESPACE_SIZE",
    "JSM_NAMESPACE_RANK",
    "JSM_NAMESPACE_LOCAL_RANK",
)


class LSFEnvironment(ClusterEnvironment):
    """``jsrun`` started every process; ranks come from ``JSM_NAMESPACE_*``, nodes from the LSF rankfile.

    The rankfile (path in ``LSB_DJOB_RANKFILE``) lists one host per line; its first line is the launch
    node, which runs no training process and is skipped. The remaining distinct hosts, in order of first
    appearance, are the compute nodes.
    """

    launcher_name = "LSF's jsrun"

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        """The first compute host in the rankfile."""
        return self._compute_hosts()[0]

    @property
    @override
    def main_port(self) -> int:
        """``MASTER_PORT`` if set, else ``10000`` plus the last four digits of ``LSB_JOBID`` (same on every node)."""
        if "MASTER_PORT" in self._environ:
            return self._int("MASTER_PORT")
        job_id = self._require("LSB_JOBID")
        try:
            return 10000 + int(job_id[-4:])
        except ValueError:
            raise ValueError(f"Cannot derive a port from LSB_JOBID={job_id!r}; set MASTER_PORT.") from None

    @classmethod
    @override
    def detect(cls, environ: Mapping[str, str] | None = None) -> bool:
        """The LSF job id and rankfile and the ``jsrun`` rank variables are all set."""
        environ = cls._resolve_environ(environ)
        return all(name in environ for name in _DETECT_VARIABLES)

    @override
    def world_size(self) -> int:
        return self._int("JSM_NAMESPACE_SIZE")

    @override
    def global_rank(self) -> int:
        return self._int("JSM_NAMESPACE_RANK")

    @override
    def local_rank(self) -> int:
        return self._int("JSM_NAMESPACE_LOCAL_RANK")

    @override
    def local_world_size(self) -> int | None:
        """``JSM_NAMESPACE_LOCAL_SIZE`` when jsrun sets it."""
        return self._int("JSM_NAMESPACE_LOCAL_SIZE") if "JSM_NAMESPACE_LOCAL_SIZE" in self._environ else None

    @override
    def node_rank(self) -> int:
        """Index of this host (``socket.gethostname()``) among the compute hosts of the rankfile."""
        hosts = self._compute_hosts()
        hostname = socket.gethostname()
        if hostname in hosts:
            return hosts.index(hostname)
        # The rankfile and gethostname() may disagree on the domain part; compare short names then.
        short_hosts = [host.split(".")[0] for host in hosts]
        short_name = hostname.split(".")[0]
        if short_name in short_hosts:
            return short_hosts.index(short_name)
        raise ValueError(f"This host {hostname!r} is not among the compute hosts {hosts} of the LSF rankfile.")

    def _compute_hosts(self) -> list[str]:
        """Distinct hosts of the rankfile after the launch node, in order of first appearance."""
        path = self._require("LSB_DJOB_RANKFILE")
        try:
            with open(path, encoding="utf-8") as file:
                lines = [line.strip() for line in file if line.strip()]
        except OSError as error:
            raise ValueError(f"Cannot read the LSF rankfile LSB_DJOB_RANKFILE={path!r}: {error}") from error
        hosts = list(dict.fromkeys(lines[1:]))
        if not hosts:
            raise ValueError(f"The LSF rankfile {path!r} lists no compute hosts after the launch node.")
        return hosts
