"""Parse the ``devices`` argument users type into one normal form, independent of the accelerator.

Accepted: an int ``>= 1`` (a count), ``-1`` (all), a list/tuple of indices, a string such as
``"2"`` (a count), ``"0,1"`` or ``"1,"`` (indices), ``"-1"`` or ``"auto"``. Each accelerator then
interprets the normal form (:meth:`fabric.accelerators.Accelerator.resolve_devices`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

AUTO: Literal["auto"] = "auto"
ALL = -1

#: The normal form: ``"auto"``, ``-1`` for all, a positive count, or a tuple of device indices.
DeviceRequest = Literal["auto"] | int | tuple[int, ...]
DevicesArg = int | str | Sequence[int]

ACCEPTED_DEVICES = (
    "an int >= 1 (how many), -1 (all), a list of indices such as [0, 1], a string such as '2' or '0,1', or 'auto'"
)


def _invalid(devices: object) -> ValueError:
    return ValueError(f"devices={devices!r} is not valid. Accepted: {ACCEPTED_DEVICES}.")


def parse_devices(devices: DevicesArg) -> DeviceRequest:
    """Normalise ``devices``; raises ``ValueError`` naming the bad value and the accepted forms."""
    if isinstance(devices, bool):
        raise _invalid(devices)
    if isinstance(devices, int):
        if devices == ALL or devices >= 1:
            return devices
        raise _invalid(devices)
    if isinstance(devices, str):
        text = devices.strip()
        if text == AUTO:
            return AUTO
        if "," in text:
            parts = [part.strip() for part in text.split(",") if part.strip()]
            if not parts or not all(part.isdigit() for part in parts):
                raise _invalid(devices)
            return _check_indices(tuple(int(part) for part in parts), devices)
        if text == "-1":
            return ALL
        if text.isdigit() and int(text) >= 1:
            return int(text)
        raise _invalid(devices)
    if isinstance(devices, Sequence) and devices:
        if not all(isinstance(index, int) and not isinstance(index, bool) for index in devices):
            raise _invalid(devices)
        return _check_indices(tuple(int(index) for index in devices), devices)
    raise _invalid(devices)


def _check_indices(indices: tuple[int, ...], original: object) -> tuple[int, ...]:
    if any(index < 0 for index in indices) or len(set(indices)) != len(indices):
        raise ValueError(
            f"devices={original!r} must list distinct, non-negative device indices. Accepted: {ACCEPTED_DEVICES}."
        )
    return indices


#: More CPU processes than this many per core is almost surely a mistake (e.g. devices=100000): warned of.
OVERSUBSCRIPTION_WARNING_FACTOR = 4


def cpu_oversubscription(count: int, cores: int, option: str) -> str | None:
    """The warning for ``count`` CPU processes on a node of ``cores`` cores (``option``: how the user asked, e.g.
    ``devices`` or ``--devices``), or ``None`` when there are at most :data:`OVERSUBSCRIPTION_WARNING_FACTOR` per
    core. Fabric and the CLI give the same warning for the same count."""
    if count <= OVERSUBSCRIPTION_WARNING_FACTOR * cores:
        return None
    return (
        f"{option}={count} starts {count} CPU processes on this node, which has {cores} cores "
        f"({count / cores:.0f} per core): each gets a sliver of a core and its own copy of the model, and "
        f"the job may exhaust memory or take ages to start. Did you mean {option}={cores} (or {option}=-1)?"
    )
