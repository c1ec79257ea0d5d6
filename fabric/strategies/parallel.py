"""The base of every multi-process strategy: ranks from the cluster environment, a process group,
and collectives through ``torch.distributed``."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import PrefixStore, Store
from torch.utils.data import DataLoader
from typing_extensions import TypedDict, Unpack, override

from fabric.accelerators.accelerator import Accelerator
from fabric.plugins.environments import (
    ClusterEnvironment,
    LocalEnvironment,
    TorchElasticEnvironment,
    detect_environment,
)
from fabric.plugins.io.background_saves import written_by_rank_zero
from fabric.plugins.io.checkpoint_io import CheckpointIO
from fabric.plugins.precision.precision import Precision
from fabric.strategies.launchers.launcher import Launcher
from fabric.strategies.launchers.subprocess_script import SubprocessScriptLauncher
from fabric.strategies.strategy import Strategy
from fabric.utilities import distributed
from fabric.utilities.cli_contract import RUN_DIRECTORY_VARIABLE
from fabric.utilities.collective_watch import CollectiveWatch
from fabric.utilities.data import shard_dataloader
from fabric.utilities.distributed import ReduceOp, parse_reduce_op
from fabric.utilities.network import socket_interface_defaults
from fabric.utilities.peer_loss import install_lost_peer_hook
from fabric.utilities.processes.rank_environment import export_variables, rank_variables, restore_variables

T = TypeVar("T")

#: torch's own default for collectives; long, because a first NCCL step can take minutes to compile.
DEFAULT_TIMEOUT = timedelta(minutes=30)
#: The least time a rank waits for the others to join the process group, whatever the collectives' timeout: on a
#: cluster ranks start minutes apart (image pulls, a slow node), and a short collective timeout must not fail a join.
JOIN_TIMEOUT_FLOOR = DEFAULT_TIMEOUT
#: After this long in one collective a rank reports what it waits in and for whom (and keeps waiting).
DEFAULT_STALL_THRESHOLD = timedelta(seconds=60)


class ParallelArgs(TypedDict, total=False):
    """The keyword arguments every parallel strategy takes (Lightning's names), declared once: a strategy forwards
    them to :class:`ParallelStrategy` as ``**common``. A new common option is added here and in
    :class:`ProcessGroupOptions`, and every strategy takes it.

    Args:
        accelerator, precision, checkpoint_io: plugins this strategy object keeps over Fabric's choice.
        cluster_environment: where ranks come from; detected (torchrun, SLURM, ...) when not given.
        parallel_devices: this node's devices, one per process; Fabric's ``devices`` when not given.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; by default NCCL on CUDA and gloo elsewhere.
        timeout: how long a collective (and ``fabric.barrier()``) waits for the other ranks before it
            fails, naming the collective, the line that called it and the ranks that never entered it.
        stall_threshold: after this long in one collective a rank prints, once, what it waits in and what
            the other ranks last entered, then keeps waiting until ``timeout``; ``0`` turns this off.
    """

    accelerator: Accelerator | None
    precision: Precision | None
    checkpoint_io: CheckpointIO | None
    cluster_environment: ClusterEnvironment | None
    parallel_devices: list[torch.device] | None
    process_group_backend: str | None
    timeout: timedelta
    stall_threshold: timedelta | float


_COMMON_NAMES = ParallelArgs.__optional_keys__


def split_common_arguments(arguments: Mapping[str, Any]) -> tuple[ParallelArgs, dict[str, Any]]:
    """``(common, own)``: the :class:`ParallelArgs` among a strategy's ``**kwargs`` and the rest, for strategies
    whose ``**kwargs`` also take options of their own (DDP: torch's ``DistributedDataParallel``'s; FSDP:
    Lightning's)."""
    common = {name: value for name, value in arguments.items() if name in _COMMON_NAMES}
    own = {name: value for name, value in arguments.items() if name not in _COMMON_NAMES}
    return cast(ParallelArgs, common), own


def refuse_unexpected_arguments(owner: type, arguments: Mapping[str, object]) -> None:
    """Python's ``TypeError`` for a keyword that is not one of :class:`ParallelArgs`: a ``**common`` parameter
    accepts any keyword at run time, and a misspelt option must not be dropped silently."""
    unexpected = sorted(set(arguments) - _COMMON_NAMES)
    if unexpected:
        raise TypeError(
            f"{owner.__name__}() got unexpected keyword arguments {unexpected}. Accepted besides its own: "
            f"{sorted(_COMMON_NAMES)}."
        )


@dataclass(frozen=True)
class ProcessGroupOptions:
    """How a parallel strategy joins the process group and watches its collectives, validated and normalised
    from :class:`ParallelArgs` (see there for what each means)."""

    #: ``None``: NCCL on CUDA, gloo elsewhere.
    backend: str | None
    timeout: timedelta
    #: Seconds; 0 turns the stall report off.
    stall_threshold: float

    @classmethod
    def from_arguments(cls, arguments: ParallelArgs) -> ProcessGroupOptions:
        """The options given among ``arguments``, the defaults for the others; a ``ValueError`` names a bad value."""
        backend = arguments.get("process_group_backend")
        if backend is not None and not isinstance(backend, str):
            raise ValueError(
                f"process_group_backend={backend!r} is not valid. Accepted: a torch.distributed backend name "
                "('gloo', 'nccl', 'mpi', ...), or None for NCCL on CUDA and gloo elsewhere."
            )
        timeout = arguments.get("timeout", DEFAULT_TIMEOUT)
        if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
            raise ValueError(f"timeout={timeout!r} is not valid. Accepted: a timedelta greater than 0.")
        return cls(backend, timeout, _seconds(arguments.get("stall_threshold", DEFAULT_STALL_THRESHOLD)))


class ParallelStrategy(Strategy):
    """Several processes, one device each, joined in a ``torch.distributed`` process group.

    Takes the keyword arguments of :class:`ParallelArgs`; subclasses add their own and forward these.
    ``fabric.launch()`` re-runs the script once per local rank unless a subclass launches otherwise.
    """

    def __init__(self, **common: Unpack[ParallelArgs]) -> None:
        refuse_unexpected_arguments(type(self), common)
        super().__init__(
            accelerator=common.get("accelerator"),
            precision=common.get("precision"),
            checkpoint_io=common.get("checkpoint_io"),
        )
        self._cluster_environment = common.get("cluster_environment")
        self._parallel_devices = common.get("parallel_devices")
        self._num_nodes = 1
        #: Read when the process group is joined (at launch): replace it before then to change it.
        self.process_group_options = ProcessGroupOptions.from_arguments(common)
        self._barrier_group: Any = None
        self._background_group: Any = None
        self._watch: CollectiveWatch | None = None
        self._replaced_variables: dict[str, str | None] | None = None  # what setup_environment exported over

    @override
    def _configure_processes(
        self, devices: list[torch.device], num_nodes: int, cluster_environment: ClusterEnvironment | None
    ) -> None:
        self._parallel_devices = self._parallel_devices or devices
        self._num_nodes = num_nodes
        self._cluster_environment = self._cluster_environment or cluster_environment or detect_environment()
        self._cluster_environment.validate_settings(len(self.parallel_devices), num_nodes)
        self._assign_local_ranks()

    @property
    @override
    def own_cluster_environment(self) -> ClusterEnvironment | None:
        return self._cluster_environment

    @property
    def cluster_environment(self) -> ClusterEnvironment:
        if self._cluster_environment is None:
            raise RuntimeError(f"{type(self).__name__} has no cluster environment; it must be set up through Fabric.")
        return self._cluster_environment

    @property
    def parallel_devices(self) -> list[torch.device]:
        if not self._parallel_devices:
            raise RuntimeError(f"{type(self).__name__} has no devices; it must be set up through Fabric.")
        return self._parallel_devices

    @property
    def num_processes(self) -> int:
        """Processes on this node."""
        return len(self.parallel_devices)

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @property
    @override
    def needs_launch(self) -> bool:
        return not self.cluster_environment.creates_processes_externally

    @property
    @override
    def launcher(self) -> Launcher | None:
        if self._launcher is None:
            self._launcher = SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        return self._launcher

    @property
    @override
    def module_calls_need_wrapper(self) -> bool:
        """DDP, FSDP and DeepSpeed all do their work around ``module(...)``, even with one process."""
        return True

    @property
    @override
    def global_rank(self) -> int:
        return self.cluster_environment.global_rank()

    @property
    @override
    def local_rank(self) -> int:
        return self.cluster_environment.local_rank()

    @property
    @override
    def node_rank(self) -> int:
        return self.cluster_environment.node_rank()

    @property
    @override
    def world_size(self) -> int:
        return self.cluster_environment.world_size()

    @property
    @override
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank]

    @override
    def process_dataloader(self, dataloader: DataLoader[Any]) -> DataLoader[Any]:
        """Give this rank only its share of the data (see :attr:`data_parallel_shard`)."""
        replicas, index = self.data_parallel_shard
        return shard_dataloader(dataloader, num_replicas=replicas, rank=index)

    @property
    def timeout(self) -> timedelta:
        """How long collectives and barriers wait for the other ranks."""
        return self.process_group_options.timeout

    @property
    def stall_threshold(self) -> float:
        """Seconds in one collective after which a rank reports what it waits for (0: never)."""
        return self.process_group_options.stall_threshold

    @property
    def process_group_backend(self) -> str:
        if self.process_group_options.backend is not None:
            return self.process_group_options.backend
        return "nccl" if self.parallel_devices[0].type == "cuda" else "gloo"

    def _assign_local_ranks(self) -> None:
        """Our own launchers number processes node by node; tell the local environment so."""
        environment = self.cluster_environment
        if isinstance(environment, LocalEnvironment):
            environment.set_world_size(self.num_processes * self.num_nodes)
            environment.set_global_rank(environment.node_rank() * self.num_processes + environment.local_rank())

    @override
    def setup_environment(self) -> None:
        """Join the process group (rank 0 hosts the rendezvous) and claim this rank's device."""
        self._assign_local_ranks()
        if self._replaced_variables is None:
            self._replaced_variables = export_variables(self._process_variables())
        # a rank that only lost its peer says so in one line (and tells `fabric run` a lost peer from a cause)
        install_lost_peer_hook(self.global_rank, os.environ.get(RUN_DIRECTORY_VARIABLE))
        self.accelerator.setup_device(self.root_device)
        if "OMP_NUM_THREADS" not in os.environ:  # share the cores instead of oversubscribing them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.num_processes))
        if not dist.is_initialized():
            store = self._join_store()
            dist.init_process_group(
                self.process_group_backend,
                store=store,
                world_size=self.world_size,
                rank=self.global_rank,
                timeout=self.timeout,
            )
            store.set_timeout(self.timeout)  # joined: the store's waits (barriers, hang reports) are collectives now
        # Barriers run on their own gloo group: it can name missing ranks (monitored_barrier) and never
        # interleaves with the training collectives of the default group.
        self._barrier_group = dist.new_group(backend="gloo", timeout=self.timeout)
        if self.world_size > 1 and self._watch is None:
            self._watch = CollectiveWatch(
                distributed.default_store(), self.global_rank, self.world_size, self.timeout, self.stall_threshold
            )

    def _process_variables(self) -> dict[str, str]:
        """What every rank exports, whoever started it: torch's standard rank variables, which libraries that
        know no launcher read (mosaicml-streaming, data loaders), and the interface gloo and NCCL must bind to
        reach the other nodes, unless set."""
        environment = self.cluster_environment
        return {
            **rank_variables(
                main_address=environment.main_address,
                main_port=environment.main_port,
                world_size=self.world_size,
                local_world_size=self.num_processes,
                local_rank=self.local_rank,
                global_rank=self.global_rank,
                node_rank=self.node_rank,
            ),
            **socket_interface_defaults(environment.main_address, environment.main_port),
        }

    @property
    def join_timeout(self) -> timedelta:
        """How long a rank waits for all others to join the process group: the collectives' timeout, at least
        :data:`JOIN_TIMEOUT_FLOOR`."""
        return max(self.timeout, JOIN_TIMEOUT_FLOOR)

    def _join_store(self) -> Store:
        """The store the ranks find each other through, waiting :attr:`join_timeout` for them; rank 0 hosts it
        unless torchrun's agent does."""
        environment = self.cluster_environment
        agent_hosts = (
            isinstance(environment, TorchElasticEnvironment)
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        )
        store = dist.TCPStore(  # type: ignore[attr-defined]  # exported at run time, not in the stubs
            environment.main_address,
            environment.main_port,
            self.world_size,
            is_master=not agent_hosts and self.global_rank == 0,
            timeout=self.join_timeout,
            multi_tenant=True,
        )
        if not agent_hosts:
            return store
        # torch-workaround(torchrun-agent-store-reused): torchrun's agent hosts the store at MASTER_PORT and keeps it
        # across restarts, and env:// joins it unprefixed: join it under a prefix of this attempt, or a restarted
        # attempt reads the previous attempt's gloo addresses ("connectFullMesh ... Connection refused", or a hang).
        return PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)

    @override
    def teardown(self) -> None:
        self.background_saves.wait()  # its collectives need the process group
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        if dist.is_initialized():
            dist.destroy_process_group()
        self._barrier_group = self._background_group = None
        if self._replaced_variables is not None:
            restore_variables(self._replaced_variables)
            self._replaced_variables = None
        super().teardown()

    def background_group(self) -> Any:
        """The gloo group the collectives of background saves run on, never interleaving with training's on
        the default group (made at the first background save: every rank is there)."""
        if self._background_group is None:
            self._background_group = dist.new_group(backend="gloo", timeout=self.timeout)
        return self._background_group

    @override
    def _background_saves_group(self) -> Any:
        return self.background_group() if self._distributed() else None

    @override
    def write_from_rank_zero_in_background(self, write: Callable[[], None] | None, description: str) -> Future[None]:
        """Every rank's future completes when rank 0's write has, and fails if it failed: a rank that loads
        after its future completed (or whose next save or load waited for it) sees the new checkpoint."""
        if not self._distributed():
            return super().write_from_rank_zero_in_background(write, description)
        shared = functools.partial(written_by_rank_zero, write, self.background_group(), description)
        return self.background_saves.submit(shared, description)

    # --- collectives ------------------------------------------------------------------------------

    def _distributed(self) -> bool:
        return dist.is_initialized() and self.world_size > 1

    def _collective(self, name: str, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a collective under the watch: on failure or stall it is reported by name and call site."""
        if self._watch is None:
            return function(*args, **kwargs)
        return self._watch.call(name, function, *args, **kwargs)

    @override
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Under the collective watch: the gradient exchange inside (DDP's all-reduce, FSDP's reduce-scatter)
        waits for every rank, so a rank left there by one that skipped its backward is reported by name, call
        site and what the others entered, like any collective."""
        self._exchanging_gradients(super().backward, tensor, module, *args, **kwargs)

    def _exchanging_gradients(self, backward: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        if self._watch is None:
            backward(*args, **kwargs)
        else:
            self._watch.call_computation("fabric.backward", backward, *args, **kwargs)

    @override
    def barrier(self, name: str | None = None) -> None:
        if self._distributed():
            # monitored_barrier (gloo) also names the ranks that did not arrive
            self._collective(
                f"barrier {name!r}" if name else "fabric.barrier",
                dist.monitored_barrier,
                group=self._barrier_group,
                timeout=self.timeout,
                wait_all_ranks=True,
            )

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self._distributed():
            return obj
        return self._collective("fabric.broadcast", distributed.broadcast_object, obj, src)

    @override
    def all_gather(self, tensor: torch.Tensor, sync_grads: bool = False) -> Any:
        if not self._distributed():
            return tensor.unsqueeze(0)
        return self._collective("fabric.all_gather", distributed.all_gather, tensor, sync_grads)

    @override
    def all_reduce(self, tensor: torch.Tensor, reduce_op: ReduceOp = "mean") -> torch.Tensor:
        parse_reduce_op(reduce_op)
        if not self._distributed():
            return super().all_reduce(tensor, reduce_op)
        return self._collective("fabric.all_reduce", distributed.all_reduce, tensor, reduce_op)


def _seconds(stall_threshold: timedelta | float) -> float:
    """``stall_threshold`` in seconds; a ``ValueError`` names a value that is not a duration of 0 or more."""
    seconds: float | None = None
    if isinstance(stall_threshold, timedelta):
        seconds = stall_threshold.total_seconds()
    elif isinstance(stall_threshold, (int, float)) and not isinstance(stall_threshold, bool):
        seconds = float(stall_threshold)
    if seconds is None or not seconds >= 0:  # `not >=` also refuses NaN
        raise ValueError(
            f"stall_threshold={stall_threshold!r} is not valid. Accepted: a timedelta or seconds >= 0 (0: off)."
        )
    return seconds
