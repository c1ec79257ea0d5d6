"""Composer's ``composer.utils.dist``: the process facts and collectives by Composer's names, for Composer programs.

As in Composer, the facts come from the launcher's environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_WORLD_SIZE``,
``LOCAL_RANK``, ``NODE_RANK``; every launcher here exports them) and, once ``torch.distributed`` is initialised (the
Trainer's Fabric does it), from the process group, which must agree with them. The collectives work in place on the
default group; before a group exists they are no-ops in a world of one and raise, naming the world size, in a larger
one (a rank that skipped the collective would hang the others). New code can use Fabric's own collectives.
"""

from __future__ import annotations

import datetime
import os
import random
import string
import time
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as torch_dist
from torch.utils.data import Dataset, DistributedSampler

from fabric.trainer.devices import Device, get_device

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "get_global_rank",
    "get_local_rank",
    "get_local_world_size",
    "get_node_rank",
    "get_node_signal_file_name",
    "get_sampler",
    "get_world_size",
    "initialize_dist",
    "is_available",
    "is_initialized",
    "local_rank_zero_download_and_wait",
    "run_local_rank_zero_first",
    "write_signal_file",
]

T = TypeVar("T")
#: Composer's ``reduce_operation`` names (``torch.distributed.ReduceOp`` members).
REDUCE_OPERATIONS = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
#: How often a waiting local rank looks for the file its local rank zero downloads.
FILE_POLL_SECONDS = 0.1


def is_available() -> bool:
    return torch_dist.is_available()


def is_initialized() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized()


def _fact(variable: str, default: int, from_group: Callable[[], int] | None = None) -> int:
    """The launcher's ``variable``; with a process group, the group's value, which must agree with it."""
    given = os.environ.get(variable)
    if is_initialized() and from_group is not None:
        value = from_group()
        if given is not None and int(given) != value:
            raise RuntimeError(
                f"The environment says {variable}={given}, and torch.distributed says {value}: the process was "
                "started by one launcher and joined another's group."
            )
        return value
    if given is not None:
        return int(given)
    if is_initialized():
        raise RuntimeError(
            f"torch.distributed is initialised but {variable} is not set: start the job with a launcher."
        )
    return default


def initialize_dist(device: str | Device | None = None, timeout: float = 300.0) -> None:
    """Join the job's process group now, from the launcher's variables, with ``device``'s backend (Composer's call
    before a program builds its Trainer, which then adopts the group). A process started without a launcher gets a
    group of one, as in Composer; a group that exists already must use the same backend."""
    backend = get_device(device).dist_backend
    if is_initialized():
        if torch_dist.get_backend() != backend:
            raise RuntimeError(
                f"initialize_dist({device!r}): torch.distributed is initialised with {torch_dist.get_backend()!r}, "
                f"not {backend!r}."
            )
        return
    world_size = get_world_size()
    if world_size == 1 and all(os.environ.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK")):
        os.environ.update(dict.fromkeys(("RANK", "LOCAL_RANK", "NODE_RANK"), "0"))
        os.environ.update(dict.fromkeys(("WORLD_SIZE", "LOCAL_WORLD_SIZE"), "1"))
        store = torch_dist.HashStore()  # type: ignore[attr-defined]  # exported at run time, not in the stubs
        torch_dist.init_process_group(backend, store=store, world_size=1, rank=0)
        return
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"initialize_dist: WORLD_SIZE={world_size} but {', '.join(missing)} not set; start the job with a "
            "launcher (fabric run model, torchrun, srun)."
        )
    torch_dist.init_process_group(
        backend,
        init_method="env://",
        world_size=world_size,
        rank=get_global_rank(),
        timeout=datetime.timedelta(seconds=timeout),
    )


def get_world_size() -> int:
    return _fact("WORLD_SIZE", 1, torch_dist.get_world_size)


def get_global_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in the job (with ``group``: its rank within that group)."""
    if group is not None:
        return torch_dist.get_rank(group)
    return _fact("RANK", 0, torch_dist.get_rank)


def get_local_world_size() -> int:
    return _fact("LOCAL_WORLD_SIZE", 1)


def get_local_rank() -> int:
    return _fact("LOCAL_RANK", 0)


def get_node_rank() -> int:
    return _fact("NODE_RANK", 0)


def _alone(operation: str) -> bool:
    """True to skip ``operation`` (a world of one without a group); raises when a larger world has no group."""
    if is_initialized():
        return False
    world_size = get_world_size()
    if world_size == 1:
        return True
    raise RuntimeError(
        f"{operation}() in a world of {world_size} processes, but torch.distributed is not initialised: the Trainer "
        "initialises it when it is built (or call fabric.launch() first)."
    )


def barrier(group: ProcessGroup | None = None) -> None:
    if not _alone("barrier"):
        torch_dist.barrier(group=group)


def all_reduce(tensor: torch.Tensor, reduce_operation: str = "SUM", group: ProcessGroup | None = None) -> None:
    """Reduce ``tensor`` in place over the ranks; ``reduce_operation`` is one of :data:`REDUCE_OPERATIONS`."""
    if reduce_operation.upper() not in REDUCE_OPERATIONS:
        raise ValueError(f"reduce_operation={reduce_operation!r} is not one of {list(REDUCE_OPERATIONS)}.")
    if not _alone("all_reduce"):
        torch_dist.all_reduce(tensor, op=getattr(torch_dist.ReduceOp, reduce_operation.upper()), group=group)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None) -> None:
    """Overwrite ``tensor`` in place with rank ``src``'s."""
    if not _alone("broadcast"):
        torch_dist.broadcast(tensor, src=src, group=group)


def broadcast_object_list(object_list: list[Any], src: int = 0, group: ProcessGroup | None = None) -> None:
    """Overwrite ``object_list``'s items in place with rank ``src``'s (picklable objects)."""
    if not _alone("broadcast_object_list"):
        torch_dist.broadcast_object_list(object_list, src=src, group=group)


def all_gather(tensor: torch.Tensor, group: ProcessGroup | None = None) -> Sequence[torch.Tensor]:
    """Every rank's ``tensor`` (all of the same shape), in rank order."""
    if _alone("all_gather"):
        return [tensor]
    gathered = [torch.zeros_like(tensor) for _ in range(torch_dist.get_world_size(group))]
    torch_dist.all_gather(gathered, tensor, group=group)
    return gathered


def all_gather_object(obj: T, group: ProcessGroup | None = None) -> list[T]:
    """Every rank's ``obj`` (picklable), in rank order."""
    if _alone("all_gather_object"):
        return [obj]
    gathered: list[Any] = [None] * torch_dist.get_world_size(group)
    torch_dist.all_gather_object(gathered, obj, group=group)
    return gathered


def get_sampler(
    dataset: Dataset[Any],
    *,
    drop_last: bool = False,
    shuffle: bool = False,
    num_replicas: int | None = None,
    rank: int | None = None,
    seed: int = 0,
) -> DistributedSampler[Any]:
    """A ``DistributedSampler`` over the job's ranks (or ``num_replicas``/``rank`` given), shuffling with ``seed``."""
    return DistributedSampler(
        dataset,
        drop_last=drop_last,
        shuffle=shuffle,
        num_replicas=get_world_size() if num_replicas is None else num_replicas,
        rank=get_global_rank() if rank is None else rank,
        seed=seed,
    )


@contextmanager
def local_rank_zero_download_and_wait(expected_file_path: str) -> Generator[None, None, None]:
    """On entering, every local rank but zero waits until ``expected_file_path`` exists (local rank zero writes it);
    needs no process group, only ``LOCAL_RANK``. As in Composer, the wait is for the name alone: local rank zero
    should make the file appear whole (write it aside, then ``os.replace`` it), or the others may read a part."""
    if get_local_rank() != 0:
        while not os.path.exists(expected_file_path):
            time.sleep(FILE_POLL_SECONDS)
    yield


def get_node_signal_file_name(rng: random.Random | None = None) -> str:
    """A file name for a wait within a node (``write_signal_file``, ``local_rank_zero_download_and_wait``): random,
    and rank 0's on every rank, so that the ranks of a node agree on it."""
    suffix = "".join((rng or random.Random()).choices(string.ascii_letters + string.digits, k=6))
    names = [f"._signal_file_node{get_node_rank()}_{suffix}"]
    broadcast_object_list(names, src=0)
    return names[0]


def write_signal_file(signal_file_name: str, dir_path: str | None = None) -> str:
    """Local rank zero writes the signal file in ``dir_path`` (default: the working directory); every rank gets its
    path."""
    if dir_path is not None:
        os.makedirs(dir_path, exist_ok=True)
    path = os.path.join(dir_path or os.getcwd(), signal_file_name)
    if get_local_rank() == 0:
        with open(path, "w") as file:
            file.write("local rank zero done")
    return path


@contextmanager
def run_local_rank_zero_first() -> Generator[None, None, None]:
    """The block runs on each node's local rank zero first, then on the others (e.g. a download, then its use)."""
    if _alone("run_local_rank_zero_first"):
        yield
        return
    if get_local_rank() != 0:
        torch_dist.barrier()
        yield
    else:
        yield
        torch_dist.barrier()
