"""Processes started by SLURM's ``srun``, including the hostlist syntax SLURM uses for node lists."""

from __future__ import annotations

from collections.abc import Mapping

from fabric.plugins.environments.cluster_environment import ClusterEnvironment
from fabric.utilities.rank_zero import rank_zero_warn

#: ``SLURM_JOB_NAME`` of an allocation's interactive shell (``salloc``, ``srun --pty bash``).
_INTERACTIVE_JOB_NAMES = ("bash", "interactive")


def _split_top_level(text: str) -> list[str]:
    """Split ``text`` at commas that are not inside brackets."""
    parts: list[str] = []
    depth = 0
    start = 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"Nested brackets are not valid in a SLURM hostlist: {text!r}.")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"Unbalanced ']' in SLURM hostlist {text!r}.")
        elif char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    if depth != 0:
        raise ValueError(f"Unbalanced '[' in SLURM hostlist {text!r}.")
    parts.append(text[start:])
    return parts


def _expand_range_list(ranges: str, hostlist: str) -> list[str]:
    """``"001-003,7"`` -> ``["001", "002", "003", "7"]``; a range keeps the zero padding of its start."""
    values: list[str] = []
    for item in ranges.split(","):
        item = item.strip()
        low, sep, high = item.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"Invalid range {item!r} in SLURM hostlist {hostlist!r}.")
        if not sep:
            values.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"Decreasing range {item!r} in SLURM hostlist {hostlist!r}.")
        values.extend(str(number).zfill(len(low)) for number in range(int(low), int(high) + 1))
    return values


def _expand_host_pattern(pattern: str, hostlist: str) -> list[str]:
    """Expand one comma-free pattern; several bracket groups give every combination, in order."""
    opening = pattern.find("[")
    if opening < 0:
        return [pattern]
    closing = pattern.index("]", opening)
    prefix, ranges, rest = pattern[:opening], pattern[opening + 1 : closing], pattern[closing + 1 :]
    suffixes = _expand_host_pattern(rest, hostlist)
    return [prefix + value + suffix for value in _expand_range_list(ranges, hostlist) for suffix in suffixes]


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a SLURM hostlist such as ``"node[001-003,007],gpu-[1-2]"`` into host names, in order.

    Supports comma-separated entries, bracketed numeric ranges and lists (zero padding is kept: the width
    of a range's start), text before and after the brackets, and several bracket groups in one name.
    """
    hosts: list[str] = []
    for part in _split_top_level(hostlist.strip()):
        part = part.strip()
        if part:
            hosts.extend(_expand_host_pattern(part, hostlist))
    if not hosts:
        raise ValueError(f"The SLURM hostlist {hostlist!r} names no hosts.")
    return hosts


class SLURMEnvironment(ClusterEnvironment):
    """``srun`` started every task; SLURM's variables give the ranks and the node list."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        """The first host of ``SLURM_NODELIST`` (or ``SLURM_JOB_NODELIST``): every task computes the same."""
        nodelist = self._environ.get("SLURM_NODELIST") or self._environ.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise ValueError("SLURMEnvironment needs SLURM_NODELIST or SLURM_JOB_NODELIST, but neither is set.")
        return expand_hostlist(nodelist)[0]

    @property
    def main_port(self) -> int:
        """``MASTER_PORT`` if set, else ``10000`` plus the last four digits of ``SLURM_JOB_ID``.

        Deriving the port from the job id lets every node agree without communicating, while two jobs
        sharing a node rarely collide.
        """
        if "MASTER_PORT" in self._environ:
            return self._int("MASTER_PORT")
        job_id = self._require("SLURM_JOB_ID", "Set MASTER_PORT to choose the rendezvous port yourself.")
        try:
            return 10000 + int(job_id[-4:])
        except ValueError:
            raise ValueError(f"Cannot derive a port from SLURM_JOB_ID={job_id!r}; set MASTER_PORT.") from None

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> bool:
        """``SLURM_NTASKS`` is set and the job is a batch/``srun`` job, not an interactive allocation shell.

        Inside ``salloc`` (or ``srun --pty bash``) the SLURM variables are set, but they describe the
        allocation, not processes ``srun`` started for us: ``SLURM_JOB_NAME`` is then ``bash`` or
        ``interactive``, and Fabric must launch the processes itself like on a local machine.
        """
        environ = cls._resolve_environ(environ)
        return "SLURM_NTASKS" in environ and environ.get("SLURM_JOB_NAME") not in _INTERACTIVE_JOB_NAMES

    def world_size(self) -> int:
        return self._int("SLURM_NTASKS")

    def global_rank(self) -> int:
        return self._int("SLURM_PROCID")

    def local_rank(self) -> int:
        return self._int("SLURM_LOCALID")

    def node_rank(self) -> int:
        return self._int("SLURM_NODEID")

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Warn when ``--ntasks-per-node`` differs from ``devices``: each task drives one device."""
        ntasks_per_node = self._environ.get("SLURM_NTASKS_PER_NODE")
        if ntasks_per_node is None or not ntasks_per_node.strip().isdigit():
            return
        if int(ntasks_per_node) != num_devices:
            rank_zero_warn(
                f"SLURM_NTASKS_PER_NODE={ntasks_per_node} but Fabric was configured with devices={num_devices}."
                f" Set `#SBATCH --ntasks-per-node={num_devices}` so that `--ntasks-per-node` equals `devices`."
            )
