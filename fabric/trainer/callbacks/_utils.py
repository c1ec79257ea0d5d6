"""What several built-in callbacks share: the training device, the user's model, the rank, file names, checks."""

from __future__ import annotations

import string
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fabric.trainer.core.time import Time, TimeUnit
from fabric.wrappers import FabricModule

if TYPE_CHECKING:
    from fabric.trainer.core.state import State

#: Fields a folder or file name of a callback may use, and where their values come from.
NAME_FIELDS = ("run_name", "rank", "epoch", "batch", "sample", "token", "batch_in_epoch")


def training_device(state: State) -> torch.device:
    """The device training runs on: Fabric's, or else where the model's first parameter lives."""
    if state.fabric is not None:
        device: torch.device = state.fabric.device
        return device
    parameter = next(state.model.parameters(), None)
    return torch.device("cpu") if parameter is None else parameter.device


def user_model(state: State) -> nn.Module:
    """The user's own module, without Fabric's wrapper."""
    return state.model.module if isinstance(state.model, FabricModule) else state.model


def global_rank(state: State) -> int:
    return 0 if state.fabric is None else int(state.fabric.global_rank)


def world_size(state: State) -> int:
    return 1 if state.fabric is None else int(state.fabric.world_size)


def check_name(template: str, what: str, fields: tuple[str, ...] = NAME_FIELDS) -> str:
    """Fail now, naming the field, unless ``template`` is a string whose only ``{fields}`` are ``fields``."""
    if not isinstance(template, str) or not template:
        raise ValueError(f"{what} must be a non-empty string; got {template!r}.")
    try:
        used = {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}
    except ValueError as error:
        raise ValueError(f"{what}={template!r} is not a valid format string: {error}.") from None
    unknown = sorted(used - set(fields))
    if unknown:
        raise ValueError(f"{what}={template!r} uses {unknown}; the fields it may use are {list(fields)}.")
    return template


def check_file_name(template: str, what: str) -> str:
    """:func:`check_name`, and no folders in it (they belong in ``folder``)."""
    check_name(template, what)
    if "/" in template or "\\" in template:
        raise ValueError(f"{what}={template!r} must be a file name without folders; put folders in folder.")
    return template


def format_name(template: str, state: State) -> str:
    """``template`` with the run name, this process's rank and the training clock filled in."""
    timestamp = state.timestamp
    return template.format(
        run_name=state.run_name or "run",
        rank=global_rank(state),
        epoch=int(timestamp.epoch),
        batch=int(timestamp.batch),
        sample=int(timestamp.sample),
        token=int(timestamp.token),
        batch_in_epoch=int(timestamp.batch_in_epoch),
    )


def uses_clock(template: str) -> bool:
    """Whether names made from ``template`` change as training advances."""
    used = {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}
    return bool(used - {"run_name", "rank"})


def check_local_files(owner: str, remote_file_name: str | None, overwrite: object) -> bool:
    """Composer's ``remote_file_name`` (an upload) must be None: these callbacks write to their folder only.
    Returns ``overwrite``, checked to be a bool."""
    if remote_file_name is not None:
        raise ValueError(
            f"remote_file_name={remote_file_name!r} is not supported: {owner} writes its files to folder only; pass "
            "remote_file_name=None and copy them from there (or point folder at a mounted bucket)."
        )
    if not isinstance(overwrite, bool):
        raise ValueError(f"overwrite must be True or False; got {overwrite!r}.")
    return overwrite


def check_count(value: object, what: str, minimum: int) -> int:
    """``value`` if it is a whole number (not a bool) of at least ``minimum``; else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be a whole number, at least {minimum}; got {value!r}.")
    return value


def check_interval(value: Any, what: str, units: tuple[TimeUnit, ...] = (TimeUnit.BATCH, TimeUnit.EPOCH)) -> Time[int]:
    """A positive interval in one of ``units``: a Time, a time string (``'25ba'``) or a whole number of batches."""
    accepted = " or ".join(f"'N{unit.value}'" for unit in units)
    try:
        interval = Time.from_input(value, TimeUnit.BATCH)
    except (TypeError, ValueError):
        raise ValueError(f"{what}={value!r} is not an interval; accepted: a positive {accepted}, or an int.") from None
    if interval.unit not in units or not isinstance(interval.value, int) or interval.value < 1:
        raise ValueError(f"{what}={value!r} is not an interval; accepted: a positive {accepted}, or an int.")
    return interval
