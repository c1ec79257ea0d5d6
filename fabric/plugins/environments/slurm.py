"""Processes started by SLURM's ``srun``, including the hostlist syntax SLURM uses for node lists."""

from __future__ import annotations

from collections.abc import Mapping

from typing_extensions import override

from fabric.plugins.environments.cluster_environment import ClusterEnvironment

#: ``SLURM_JOB_NAME`` of ``srun --pty bash``: an interactive shell in a one-task step, where the user's script
#: is not a task of its own and Fabric starts the processes itself. (``salloc``'s name, ``interactive``, is not
#: one: an ``srun`` inside ``salloc`` inherits it, and its tasks are a real step.)
_INTERACTIVE_SHELL_JOB_NAMES = ("bash",)


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


def expand_tasks_per_node(counts: str) -> list[int]:
    """Expand SLURM's tasks-per-node syntax such as ``"2(x3),1"`` into one count per node: ``[2, 2, 2, 1]``."""
    expanded: list[int] = []
    for item in counts.split(","):
        count, repeated, times = item.strip().partition("(x")
        if not count.isdigit() or (repeated and not (times.endswith(")") and times[:-1].isdigit())):
            raise ValueError(f"Invalid SLURM tasks-per-node list {counts!r}: cannot read {item!r}.")
        expanded.extend([int(count)] * (int(times[:-1]) if repeated else 1))
    return expanded


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

    launcher_name = "SLURM's srun"

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        """The first host of ``SLURM_NODELIST`` (or ``SLURM_JOB_NODELIST``): every task computes the same."""
        nodelist = self._environ.get("SLURM_NODELIST") or self._environ.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise ValueError("SLURMEnvironment needs SLURM_NODELIST or SLURM_JOB_NODELIST, but neither is set.")
        return expand_hostlist(nodelist)[0]

    @property
    @override
    def main_port(self) -> int:
        """``MASTER_PORT`` if set, else ``10000`` plus the last four digits of ``SLURM_JOB_ID``, plus ``10000`` per
        job step (``SLURM_STEP_ID``), wrapping within 10000-32767 (below Linux's ephemeral ports).

        Deriving the port from the job and step ids lets every node of a step agree without communicating, while two
        jobs sharing a node rarely collide, and job steps of one allocation running side by side on a node (fault
        tolerance's replica groups, one ``srun`` each) never do.
        """
        if "MASTER_PORT" in self._environ:
            return self._int("MASTER_PORT")
        job_id = self._require("SLURM_JOB_ID", "Set MASTER_PORT to choose the rendezvous port yourself.")
        step_id = self._environ.get("SLURM_STEP_ID", "0")
        try:
            job, step = int(job_id[-4:]), int(step_id)
        except ValueError:
            raise ValueError(
                f"Cannot derive a port from SLURM_JOB_ID={job_id!r} and SLURM_STEP_ID={step_id!r}; set MASTER_PORT."
            ) from None
        return 10000 + (job + 10000 * step) % (32768 - 10000)

    @classmethod
    @override
    def detect(cls, environ: Mapping[str, str] | None = None) -> bool:
        """This process is a task of an ``srun`` job step (``SLURM_STEP_ID`` and ``SLURM_NTASKS`` are set), and
        not an interactive shell.

        An ``sbatch`` script's own shell, and a command ``salloc`` runs, see the allocation's variables
        (``SLURM_NTASKS=2`` for a 2-task job) but are one process that no ``srun`` started: there Fabric
        starts the processes itself, as on a local machine. So does a script run from ``srun --pty bash``.
        """
        environ = cls._resolve_environ(environ)
        in_step = "SLURM_STEP_ID" in environ and "SLURM_NTASKS" in environ
        return in_step and environ.get("SLURM_JOB_NAME") not in _INTERACTIVE_SHELL_JOB_NAMES

    @override
    def world_size(self) -> int:
        return self._int("SLURM_NTASKS")

    @override
    def global_rank(self) -> int:
        return self._int("SLURM_PROCID")

    @override
    def local_rank(self) -> int:
        return self._int("SLURM_LOCALID")

    @override
    def node_rank(self) -> int:
        return self._int("SLURM_NODEID")

    @override
    def local_world_size(self) -> int | None:
        """This node's entry of the step's tasks per node (``SLURM_STEP_TASKS_PER_NODE``, else the job's)."""
        per_node = self._tasks_per_node()
        if per_node is None:
            return None
        node = self.node_rank()
        if node >= len(per_node):
            raise ValueError(f"SLURM_NODEID={node}, but the tasks-per-node list {per_node} has {len(per_node)} nodes.")
        return per_node[node]

    @override
    def launched_num_nodes(self) -> int | None:
        """The nodes of the step's tasks-per-node list, which may differ in size (``srun -n 3 -N 2``)."""
        per_node = self._tasks_per_node()
        return None if per_node is None else len(per_node)

    def _tasks_per_node(self) -> list[int] | None:
        counts = self._environ.get("SLURM_STEP_TASKS_PER_NODE") or self._environ.get("SLURM_TASKS_PER_NODE")
        return expand_tasks_per_node(counts) if counts else None
