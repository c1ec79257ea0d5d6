"""``FaultTolerance``: where this process's replica group stands among the others, resolved and validated once
(:func:`resolve_launch`; or, given no group index, ``EveryGroupHere``: this process starts every group).

A fault-tolerant run is several *replica groups*, each an ordinary Fabric world (its own launcher, process group and
rendezvous) holding a full copy of the model. torchft's lighthouse decides, step by step, which groups take part;
their gradients are averaged across the groups that do. This module reads the arguments (or the environment a
launcher set) into one frozen description and refuses a configuration that cannot work, before any process starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlsplit

from fabric.utilities.cli_contract import FT_LIGHTHOUSE, FT_REPLICA_GROUP, FT_REPLICA_GROUPS

#: How long a quorum, a gradient exchange across groups or a recovery from a peer may take before the step is given
#: up (torchft's own default).
DEFAULT_FT_TIMEOUT = timedelta(seconds=60)


@dataclass(frozen=True)
class FaultTolerance:
    """One replica group's place in a fault-tolerant run.

    Attributes:
        replica_group: this group's index, ``0 <= replica_group < replica_groups``; it names the group to the
            lighthouse and picks its share of the data.
        replica_groups: how many groups the run is planned for; the data is split into this many shares.
        min_replica_groups: the fewest groups a step may commit with; below it, steps wait (and are retried).
        lighthouse: the torchft lighthouse's address, ``http://host:port``.
        timeout: how long a gradient exchange or a recovery from a peer may take before the step is given up.
        quorum_timeout: how long a step waits for the lighthouse's quorum (a joining group included); by default
            twice ``timeout``: a quorum waits for every live group, and a live group may be inside an exchange with a
            group that died, which only ``timeout`` ends. A quorum that gave up first would fail a healthy group.
    """

    replica_group: int
    replica_groups: int
    min_replica_groups: int
    lighthouse: str
    timeout: timedelta
    quorum_timeout: timedelta

    @property
    def lighthouse_host_and_port(self) -> tuple[str, int]:
        parts = urlsplit(self.lighthouse)
        assert parts.hostname is not None and parts.port is not None  # checked by _lighthouse_url
        return parts.hostname, parts.port


@dataclass(frozen=True)
class EveryGroupHere:
    """No group index given: ``fabric.launch()`` in this process starts every group on this machine (and the
    lighthouse, unless one is given) and trains in none of them, as ``fabric run model --replica-groups=N`` does.
    Under a launcher that started this process (torchrun, SLURM) it is :meth:`unplaced_error` instead."""

    replica_groups: int
    #: The lighthouse the groups join, ``http://host:port``; None: one is started for them.
    lighthouse: str | None

    def unplaced_error(self) -> ValueError:
        groups = self.replica_groups
        return ValueError(
            f"replica_group is not set: pass replica_group=I (0 to {groups - 1}, this group's index) or set "
            f"{FT_REPLICA_GROUP}; or start the lighthouse and all {groups} groups on this machine with one command, "
            f"`fabric run model --replica-groups={groups} SCRIPT` (or `python SCRIPT`, which starts them at "
            "fabric.launch())."
        )


def resolve_launch(
    replica_group: int | None = None,
    replica_groups: int | None = None,
    min_replica_groups: int = 1,
    lighthouse: str | None = None,
    timeout: timedelta = DEFAULT_FT_TIMEOUT,
    quorum_timeout: timedelta | None = None,
    environment: Mapping[str, str] | None = None,
) -> FaultTolerance | EveryGroupHere:
    """The arguments (else the launcher's variables) checked once: this process's group, or, with no group index,
    every group to start here. A ``ValueError`` names the value that cannot work and what is accepted."""
    environment = os.environ if environment is None else environment
    groups = _count(_one(replica_groups, "replica_groups", environment, FT_REPLICA_GROUPS), "replica_groups")
    index = _one(replica_group, "replica_group", environment, FT_REPLICA_GROUP)
    group = None if index is None else _index(index, groups)
    if isinstance(min_replica_groups, bool) or not isinstance(min_replica_groups, int):
        raise ValueError(f"min_replica_groups={min_replica_groups!r} is not valid. Accepted: an int >= 1.")
    if not 1 <= min_replica_groups <= groups:
        raise ValueError(
            f"min_replica_groups={min_replica_groups} cannot be met by replica_groups={groups}: no step could "
            f"ever commit. Accepted: 1 to {groups}."
        )
    if quorum_timeout is None and isinstance(timeout, timedelta):
        quorum_timeout = timeout * 2
    for name, value in (("timeout", timeout), ("quorum_timeout", quorum_timeout)):
        if not isinstance(value, timedelta) or value <= timedelta(0):
            raise ValueError(f"{name}={value!r} is not valid. Accepted: a timedelta greater than 0.")
    address = _one(lighthouse, "lighthouse", environment, FT_LIGHTHOUSE, _lighthouse_url)
    if group is None:
        return EveryGroupHere(groups, None if address is None else _lighthouse_url(address))
    assert isinstance(quorum_timeout, timedelta)  # checked above
    return FaultTolerance(
        replica_group=group,
        replica_groups=groups,
        min_replica_groups=min_replica_groups,
        lighthouse=_lighthouse_url(address),
        timeout=timeout,
        quorum_timeout=quorum_timeout,
    )


def _one(
    given: object, name: str, environment: Mapping[str, str], variable: str, normal: Callable[[object], str] = str
) -> object:
    """The argument, else the launcher's variable; both, and different (once ``normal``-ised): a ``ValueError`` (a
    group told two different places in the run must not pick one silently)."""
    if variable not in environment:
        return given
    if given is not None and normal(given) != normal(environment[variable]):
        raise ValueError(
            f"{name}={given!r} conflicts with {variable}={environment[variable]} (set by `fabric run model` or the "
            "shell). Remove one of the two."
        )
    return environment[variable]


def _count(value: object, name: str) -> int:
    if value is None:
        raise ValueError(
            f"{name} is not set: pass {name}=N (how many replica groups the run is planned for) or set "
            f"{FT_REPLICA_GROUPS}."
        )
    number = _as_int(value)
    if number is None or number < 1:
        raise ValueError(f"{name}={value!r} is not valid. Accepted: an int >= 1.")
    return number


def _index(value: object, groups: int) -> int:
    number = _as_int(value)
    if number is None or not 0 <= number < groups:
        raise ValueError(
            f"replica_group={value!r} is not valid for replica_groups={groups}. Accepted: 0 to {groups - 1}."
        )
    return number


def _as_int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def _lighthouse_url(address: object) -> str:
    """``http://host:port`` from ``host:port`` or a URL; a ``ValueError`` when missing or without a port."""
    if not address:
        raise ValueError(
            f"No torchft lighthouse: pass lighthouse='host:port' or set {FT_LIGHTHOUSE}. Start one with "
            "`fabric lighthouse --min-replicas N` (or torchft's `torchft_lighthouse`), or the lighthouse and every "
            "group on this machine with `fabric run model --replica-groups=N SCRIPT`."
        )
    if not isinstance(address, str):
        raise ValueError(f"lighthouse={address!r} is not valid. Accepted: 'host:port' or 'http://host:port'.")
    url = address if "://" in address else f"http://{address}"
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None:
        raise ValueError(f"lighthouse={address!r} is not valid. Accepted: 'host:port' or 'http://host:port'.")
    return f"http://{parts.netloc}"
