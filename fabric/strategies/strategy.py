"""The strategy interface: how modules, optimizers, collectives and checkpoints work across processes.

This base class implements the single-process semantics every strategy shares; distributed strategies
override the collectives, the module wrapping and the launcher.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader
from torch.utils.hooks import RemovableHandle

from fabric.accelerators.accelerator import Accelerator
from fabric.plugins.environments.cluster_environment import ClusterEnvironment
from fabric.plugins.io.background_saves import BackgroundSaves, finished, written_in_parts
from fabric.plugins.io.checkpoint_io import CheckpointIO, PathType, StorageOptions
from fabric.plugins.io.formats import read_whole
from fabric.plugins.io.torch_io import TorchCheckpointIO
from fabric.plugins.precision.precision import Precision
from fabric.strategies.launchers.launcher import Launcher
from fabric.utilities.checkpoint_state import (
    Stateful,
    check_module_state,
    check_optimizer_state,
    loaded_value,
    rebuilt_loaders,
    saved_form,
)
from fabric.utilities.cli_contract import CLI_MESH
from fabric.utilities.distributed import ReduceOp, parse_reduce_op
from fabric.utilities.exceptions import CheckpointError
from fabric.utilities.inheritance import inherits_unchanged
from fabric.utilities.init import (
    DeferredContexts,
    SkipParameterInit,
    refuse_forward_until_loaded,
    uninitialised_tensors,
)

#: ``fabric.save(filter={key: fn})``: ``fn(name, value)`` says whether an item of entry ``key``'s state dict is saved.
CheckpointFilter = Callable[[str, Any], bool]

#: Checkpoint entry holding the precision plugin's state (the loss scale of ``16-mixed``), if any.
PRECISION_STATE_KEY = "fabric_precision_state"
#: Where a checkpoint keeps the strategy's own run state (:meth:`Strategy.run_state`), beside the user's entries.
STRATEGY_STATE_KEY = "fabric_strategy_state"
#: Entries Fabric writes beside the user's own: restored by Fabric, never handed back as the user's.
FRAMEWORK_KEYS = frozenset({PRECISION_STATE_KEY, STRATEGY_STATE_KEY})


_WEAK_REGISTRIES = (weakref.WeakSet, weakref.WeakKeyDictionary)


if TYPE_CHECKING:
    from fabric.strategies.mesh import MeshPlan
    from fabric.strategies.pipeline import PipelinePlan


class Strategy:
    """Single-process behaviour; see :class:`~fabric.strategies.SingleDeviceStrategy`."""

    #: Derived for each subclass, never set by hand: True when it does not override :meth:`optimizer_step`
    #: (resp. :meth:`optimizer_zero_grad`, :meth:`backward`), so Fabric's optimizer wrapper calls the optimizer
    #: itself (resp. ``fabric.backward`` calls ``tensor.backward`` itself, with a plain precision), a call shorter.
    optimizer_step_is_plain: ClassVar[bool] = True
    optimizer_zero_grad_is_plain: ClassVar[bool] = True
    backward_is_plain: ClassVar[bool] = True
    #: Why ``fabric.save(..., format="huggingface")`` and loading such a folder cannot work with this strategy
    #: (one line naming what to do instead), or None where they work.
    huggingface_refusal: str | None = None
    #: How the model is cut into pipeline stages, where it is (:class:`~fabric.strategies.ModelParallelStrategy`).
    pipeline: PipelinePlan | None = None
    #: True after an :meth:`optimizer_step` this strategy discarded for the run (a fault-tolerant step that did not
    #: commit on every replica group): the batch is to be trained again, not counted (the Trainer does so).
    step_discarded: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.optimizer_step_is_plain = inherits_unchanged(cls, Strategy, "optimizer_step")
        cls.optimizer_zero_grad_is_plain = inherits_unchanged(cls, Strategy, "optimizer_zero_grad")
        cls.backward_is_plain = inherits_unchanged(cls, Strategy, "backward")

    def __init__(
        self,
        *,
        accelerator: Accelerator | None = None,
        precision: Precision | None = None,
        checkpoint_io: CheckpointIO | None = None,
    ) -> None:
        self._accelerator = accelerator
        #: How this strategy's modules compute and its optimizers step: the one given here, else what Fabric chooses
        #: in :meth:`connect`. A plain attribute, read on every forward, backward and step (the Trainer's
        #: ``fit(precision=)`` replaces it after set-up).
        self.precision: Precision = Precision() if precision is None else precision
        self._precision_given = precision is not None
        self._checkpoint_io = checkpoint_io
        self._launcher: Launcher | None = None
        #: True while :meth:`backward` runs; lets wrappers tell ``fabric.backward`` from ``loss.backward``.
        self.backward_in_progress = False
        # Modules built with empty_init whose forward is refused until a checkpoint fills them.
        self._awaiting_load: weakref.WeakKeyDictionary[nn.Module, RemovableHandle] = weakref.WeakKeyDictionary()
        #: The checkpoint being written in the background (``async_save=True``), at most one.
        self.background_saves = BackgroundSaves()

    def __getstate__(self) -> dict[str, Any]:
        # Spawned ranks receive a pickled copy. Weak registries of this process's modules cannot be pickled
        # and mean nothing there: they travel as their class and arrive empty.
        return {
            key: type(value) if isinstance(value, _WEAK_REGISTRIES) else value for key, value in self.__dict__.items()
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(
            {
                key: value() if isinstance(value, type) and issubclass(value, _WEAK_REGISTRIES) else value
                for key, value in state.items()
            }
        )

    # --- wiring (done once by the connector) -------------------------------------------------------

    def connect(
        self,
        *,
        accelerator: Accelerator,
        precision: Precision,
        checkpoint_io: CheckpointIO | None,
        devices: list[torch.device],
        num_nodes: int,
        cluster_environment: ClusterEnvironment | None = None,
    ) -> None:
        """Fill in the choices the user did not set on this strategy object themselves."""
        self._accelerator = self._accelerator or accelerator
        if not self._precision_given:
            self.precision = precision
        self._checkpoint_io = self._checkpoint_io or checkpoint_io
        self._configure_processes(devices, num_nodes, cluster_environment)
        self._connected()

    def _connected(self) -> None:
        """Settle what depends on the choices :meth:`connect` filled in (subclasses); called last by it."""

    def _configure_processes(
        self, devices: list[torch.device], num_nodes: int, cluster_environment: ClusterEnvironment | None
    ) -> None:
        """Take the devices, node count and cluster environment resolved for this job (subclasses)."""
        raise NotImplementedError

    @property
    def own_cluster_environment(self) -> ClusterEnvironment | None:
        """The cluster environment this strategy object was given itself, which wins over detection."""
        return None

    def configuration_error(self) -> str | None:
        """Why this strategy cannot work with the accelerator, precision, devices and plugins it was connected
        to, in words naming the values; ``None`` when it can. Checked when ``Fabric(...)`` is built."""
        if self._checkpoint_io is not None:
            refusal = self.checkpoint_io_refusal()
            if refusal is not None:
                return f"plugins=[{type(self._checkpoint_io).__name__}(...)]: {refusal}"
        return None

    def configure_mesh(self, plan: MeshPlan) -> None:
        """Take the device mesh ``plan`` (``fabric run model --mesh``); strategies without a mesh refuse it."""
        raise ValueError(
            f"--mesh={plan.as_text()} ({CLI_MESH}) shapes the device mesh of FSDPStrategy and ModelParallelStrategy; "
            f"this job's strategy is {type(self).__name__}, which has none. Pass --strategy=fsdp (or build one of "
            "those in the script)."
        )

    def default_precision(self) -> str | None:
        """The precision this strategy's own configuration asks for, used when ``Fabric(precision=...)`` is not
        given (``None``: Fabric's default, ``"32-true"``)."""
        return None

    def checkpoint_io_refusal(self) -> str | None:
        """Why this strategy's checkpoints cannot go through a user's ``CheckpointIO`` plugin; ``None`` when
        every save and load does. A plugin that would be ignored is refused instead."""
        return None

    @property
    def accelerator(self) -> Accelerator:
        if self._accelerator is None:
            raise RuntimeError(f"{type(self).__name__} has no accelerator; it must be set up through Fabric.")
        return self._accelerator

    @property
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = TorchCheckpointIO()
        return self._checkpoint_io

    @property
    def needs_launch(self) -> bool:
        """Whether ``fabric.launch()`` must start processes before anything else happens."""
        return False

    @property
    def launcher(self) -> Launcher | None:
        """What starts the other processes on ``fabric.launch()``; ``None`` when there is only one."""
        return self._launcher

    @property
    def launch_needs_function(self) -> bool:
        """Whether ``fabric.launch()`` starts the other processes only with a function to run in each
        (spawn/fork); False when it re-runs the script instead, or starts nothing."""
        return False

    @property
    def replicates_gradients(self) -> bool:
        """Whether every rank holds the whole gradient of every parameter after the backward, so code
        outside the strategy may skip its synchronisation and average the gradients itself (DDP)."""
        return False

    @property
    def engine_handles_gradients(self) -> bool:
        """Whether an engine of the strategy's own holds the gradients, clips them and steps the optimizers
        (DeepSpeed): code outside cannot change the gradients, and an optimizer step takes no closure."""
        return False

    @property
    def module_calls_need_wrapper(self) -> bool:
        """Whether a set-up module must be entered through this strategy's wrapper (its hooks synchronise
        gradients or gather parameters). Then methods other than ``forward`` run only when marked with
        ``mark_forward_method``. One process on one device needs no wrapper."""
        return False

    # --- where this process sits --------------------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        raise NotImplementedError

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def data_parallel_shard(self) -> tuple[int, int]:
        """``(shares, index)``: how many ranks split the data, and which share is this rank's. Every rank reads its
        own share, except that ranks holding parts of one model copy (tensor or pipeline parallelism) read one."""
        return self.world_size, self.global_rank

    @property
    def replica_group(self) -> int | None:
        """This process's replica group where the run is made of groups that fail and rejoin apart (fault
        tolerance), each with state of its own (its data position); ``None`` where the ranks are one job."""
        return None

    @property
    def batch_shares(self) -> int:
        """How many different batches one step trains (the number of data shares): a step's sample count is a
        rank's times this."""
        return self.data_parallel_shard[0]

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    def setup_environment(self) -> None:
        """Claim this process's device (and, in distributed strategies, join the process group)."""
        self.accelerator.setup_device(self.root_device)

    def teardown(self) -> None:
        self.background_saves.wait()
        self.accelerator.teardown()

    # --- modules, optimizers, data ------------------------------------------------------------------

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Wrap the module for this strategy (e.g. in DDP). The base class leaves it as it is."""
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        return optimizer

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: Sequence[Optimizer], scheduler: LRScheduler | None = None
    ) -> tuple[nn.Module, list[Optimizer]]:
        """Set up a module together with its optimizers (``fabric.setup(model, *optimizers, scheduler=)``).

        Returns the module to run the forward through and the optimizers to wrap. Strategies that must
        see them all at once (DeepSpeed builds one engine from a model, its optimizer and its learning-rate
        scheduler) override this; here the scheduler needs nothing.
        """
        return self.setup_module(module), [self.setup_optimizer(optimizer) for optimizer in optimizers]

    def module_to_device(self, module: nn.Module) -> None:
        module.to(self.root_device)

    def guard_uninitialised(self, module: nn.Module) -> None:
        """Refuse the forward of a module built with ``empty_init=True`` until a load fills the tensors it
        left uninitialised (called by ``fabric.setup`` before the module is set up)."""
        names = uninitialised_tensors(module)
        if names:
            self.refuse_forward_until_loaded(module, names, "were never initialised (empty_init=True skips it)")

    def refuse_forward_until_loaded(self, module: nn.Module, names: list[str], reason: str) -> None:
        """Make ``module``'s forward raise, naming the uninitialised ``names``, until :meth:`module_loaded`."""
        self._awaiting_load[module] = refuse_forward_until_loaded(module, names, reason)

    def module_loaded(self, module: nn.Module) -> None:
        """A checkpoint filled ``module``: lift the guard against using uninitialised weights."""
        handle = self._awaiting_load.pop(module, None)
        if handle is not None:
            handle.remove()

    def process_dataloader(self, dataloader: DataLoader[Any]) -> DataLoader[Any]:
        """Adapt a dataloader to the strategy (e.g. shard it across ranks). One process keeps all data."""
        return dataloader

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager[Any]:
        """Build modules directly on the device, in the precision's dtype, optionally uninitialised."""
        contexts = DeferredContexts(SkipParameterInit) if empty_init else DeferredContexts()
        contexts.add(lambda: self.root_device)
        contexts.add(self.precision.module_init_context)
        return contexts

    def tensor_init_context(self) -> AbstractContextManager[Any]:
        return DeferredContexts(lambda: self.root_device, self.precision.tensor_init_context)

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager[Any]:
        """Skip gradient synchronisation inside the context; nothing to skip with a single process."""
        return contextlib.nullcontext()

    def context_parallel(
        self, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int], no_restore: Sequence[torch.Tensor] = ()
    ) -> AbstractContextManager[None]:
        """Split the buffers' sequences over the mesh's ``context_parallel`` ranks inside the context; nothing to
        split without that dimension (so one loop runs on every mesh)."""
        return contextlib.nullcontext()

    # --- the step -----------------------------------------------------------------------------------

    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        precision = self.precision
        plain = precision.backward_is_plain
        if not plain:
            tensor = precision.pre_backward(tensor, module)
        self.backward_in_progress = True
        try:
            if plain:
                tensor.backward(*args, **kwargs)  # type: ignore[no-untyped-call]
            else:
                precision.backward(tensor, module, *args, **kwargs)
        finally:
            self.backward_in_progress = False

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        return self.precision.optimizer_step(optimizer, closure)

    def optimizer_zero_grad(self, optimizer: Optimizer, set_to_none: bool = True) -> None:
        """Clear the gradients ``optimizer.zero_grad()`` is meant to clear (DeepSpeed keeps them elsewhere)."""
        optimizer.zero_grad(set_to_none=set_to_none)

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        self.precision.unscale_gradients(optimizer)
        # With a GradScaler an overflowing step is expected and skipped, not an error.
        error_if_nonfinite = error_if_nonfinite and not self.precision.skips_non_finite_steps
        return torch.nn.utils.clip_grad_norm_(
            parameters_with_grad(optimizer), max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float) -> None:
        self.precision.unscale_gradients(optimizer)
        torch.nn.utils.clip_grad_value_(parameters_with_grad(optimizer), clip_val)

    # --- collectives (single-process semantics; shapes match the distributed ones) ------------------

    def barrier(self, name: str | None = None) -> None:
        """Wait for every process. With one process there is no one to wait for."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather(self, tensor: torch.Tensor, sync_grads: bool = False) -> torch.Tensor:
        """Stack every process's tensor along a new first dimension of size ``world_size``."""
        return tensor.unsqueeze(0)

    def all_reduce(self, tensor: torch.Tensor, reduce_op: ReduceOp = "mean") -> torch.Tensor:
        parse_reduce_op(reduce_op)
        if reduce_op == "mean" and not torch.is_floating_point(tensor):
            return tensor.to(torch.get_default_dtype())  # an integer mean is not truncated
        return tensor

    # --- checkpoints --------------------------------------------------------------------------------

    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        return module.state_dict()

    def module_state_dict(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """What ``state_dict()`` of the module ``fabric.setup`` returned gives: the module's own by default."""
        return module.state_dict(*args, **kwargs)

    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def checkpoint_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Replace modules, optimizers and other stateful objects by their state dicts."""
        return {key: self._state_of(value) for key, value in state.items()}

    def _state_of(self, obj: object) -> Any:
        if isinstance(obj, nn.Module):
            return self.get_module_state_dict(obj)
        if isinstance(obj, Optimizer):
            return self.get_optimizer_state(obj)
        return saved_form(obj)

    @property
    def saves_on_every_rank(self) -> bool:
        """Whether every rank writes its own part of a checkpoint (sharded strategies), not rank 0 alone."""
        return False

    def save_checkpoint(
        self,
        path: PathType,
        state: dict[str, Any],
        filter: Mapping[str, CheckpointFilter] | None = None,
        storage_options: StorageOptions = None,
        async_save: bool = False,
    ) -> Future[None]:
        """Write ``state`` from global rank 0 (every rank holds the same full state here).

        ``filter`` maps entries of ``state`` to ``(name, value) -> bool``: only the items of that entry's
        state dict for which it returns True are written. With ``async_save`` a CPU snapshot is written in
        the background; the returned future completes when the checkpoint is complete at ``path``.
        """
        checkpoint = self.checkpoint_state(state)
        if filter:
            checkpoint = _filtered(checkpoint, filter)
        precision_state = self.precision.state_dict()
        if precision_state:
            checkpoint[PRECISION_STATE_KEY] = precision_state
        run_state = self.run_state()
        if run_state:
            checkpoint[STRATEGY_STATE_KEY] = run_state
        if not async_save:
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options)
            return finished()
        write = None
        if self.is_global_zero:
            snapshot = self.background_saves.snapshot(checkpoint)
            write = functools.partial(self.checkpoint_io.save_checkpoint, snapshot, path, storage_options)
        return self.write_from_rank_zero_in_background(write, repr(os.fspath(path)))

    def write_from_rank_zero_in_background(self, write: Callable[[], None] | None, description: str) -> Future[None]:
        """Run rank 0's ``write`` (``None`` on the other ranks) on the save thread; the future completes when the
        checkpoint is complete. With one process there is no other rank to wait for it."""
        return finished() if write is None else self.background_saves.submit(write, description)

    def write_parts_in_background(
        self, write_part: Callable[[Any], None], publish: Callable[[], None] | None, description: str
    ) -> Future[None]:
        """Every rank writes its part of one checkpoint on its save thread, ``write_part(group)`` (its collectives on
        ``group``: the background saves' own, None with one process), then rank 0 runs ``publish`` (``None`` on the
        others) once every part is written; every rank's future completes when it is published, and fails if any
        part or the publishing failed (:func:`~fabric.plugins.io.background_saves.written_in_parts`)."""
        group = self._background_saves_group()
        write = functools.partial(written_in_parts, functools.partial(write_part, group), publish, group, description)
        return self.background_saves.submit(write, description)

    def _background_saves_group(self) -> Any:
        """The process group of background saves' collectives: none with one process."""
        return None

    def load_checkpoint(
        self,
        path: PathType,
        state: dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool = True,
        storage_options: StorageOptions = None,
    ) -> dict[str, Any]:
        """Load into the objects in ``state`` in place and return the checkpoint entries not asked for.

        Any format loads (a file, a sharded directory read whole in this process, a DeepSpeed directory's
        weights). Without ``state`` the whole raw checkpoint is returned. Everything is validated first,
        so an error leaves every object in ``state`` unchanged.
        """
        checkpoint = read_whole(path, self.checkpoint_io, weights_only=weights_only, storage_options=storage_options)
        if not isinstance(checkpoint, dict):
            raise CheckpointError(f"{path!s} holds a {type(checkpoint).__name__}, not a checkpoint dict.")
        if state is None:
            return rebuilt_loaders(checkpoint, weights_only)
        keys = entries_to_load(path, state, checkpoint, strict)
        for key in keys:
            self._check_fits(state[key], checkpoint[key], strict, where=f"Entry {key!r} of {path!s}")
        load_unvalidated_state(path, self.precision, state, checkpoint, keys)
        for key in keys:
            target = state[key]
            if isinstance(target, nn.Module):
                self.load_module_state_dict(target, checkpoint[key], strict=strict)
            elif isinstance(target, Optimizer):
                self.load_optimizer_state_dict(target, checkpoint[key])
            elif not isinstance(target, Stateful):
                state[key] = loaded_value(target, checkpoint[key], weights_only)
        self.load_run_state(checkpoint.get(STRATEGY_STATE_KEY), path)
        rest = {key: value for key, value in checkpoint.items() if key not in state and key not in FRAMEWORK_KEYS}
        return rebuilt_loaders(rest, weights_only)

    def share_with_joining_replicas(
        self, name: str, load: Callable[[dict[str, Any]], None], state: Callable[[], dict[str, Any]]
    ) -> None:
        """Send ``state()`` to a replica that joins the run later, which ``load``s it (fault tolerance: a Trainer's
        clock and data position beside the weights); strategies whose replicas never join do nothing."""

    def run_state(self) -> dict[str, Any]:
        """What the strategy itself keeps of the run (e.g. the fault-tolerant step count), saved with every
        checkpoint under :data:`STRATEGY_STATE_KEY`; empty: nothing is saved."""
        return {}

    def load_run_state(self, saved: dict[str, Any] | None, path: PathType) -> None:
        """Restore :meth:`run_state` from the checkpoint at ``path`` (``saved`` is None where it holds none, as one
        a normal run wrote); other runs' strategies ignore it."""

    def load_raw(
        self,
        path: PathType,
        obj: nn.Module | Optimizer,
        strict: bool = True,
        weights_only: bool = True,
        storage_options: StorageOptions = None,
    ) -> None:
        """Load a bare ``state_dict`` file (e.g. from ``torch.save(model.state_dict(), path)``) into ``obj``."""
        state_dict = self.checkpoint_io.load_checkpoint(
            path, weights_only=weights_only, storage_options=storage_options
        )
        self._check_fits(obj, state_dict, strict, where=str(path))
        if isinstance(obj, nn.Module):
            self.load_module_state_dict(obj, state_dict, strict=strict)
        else:
            self.load_optimizer_state_dict(obj, state_dict)

    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        module.load_state_dict(state_dict, strict=strict)

    def load_optimizer_state_dict(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
        """Load a full ``optimizer.state_dict()`` (sharding strategies distribute it over the ranks)."""
        optimizer.load_state_dict(state_dict)

    @staticmethod
    def _check_fits(target: Any, saved: Any, strict: bool, where: str) -> None:
        if isinstance(target, nn.Module):
            check_module_state(target, saved, strict, where)
        elif isinstance(target, Optimizer):
            check_optimizer_state(target, saved, where)
        elif isinstance(target, Stateful) and not isinstance(saved, dict):
            raise CheckpointError(
                f"{where}: expected a state dict for {type(target).__name__}, found {type(saved).__name__}."
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(accelerator={self._accelerator}, precision={self.precision})"


def entries_to_load(path: PathType, state: Mapping[str, Any], available: Collection[str], strict: bool) -> list[str]:
    """The keys of ``state`` the checkpoint at ``path`` has; under ``strict`` a missing one is an error."""
    missing = [key for key in state if key not in available]
    if strict and missing:
        raise CheckpointError(
            f"{path!s} has no entry for {missing}; it holds {sorted(available)}. "
            "Pass strict=False to load only the entries that exist."
        )
    return [key for key in state if key in available]


def load_unvalidated_state(
    path: PathType, precision: Precision, state: dict[str, Any], checkpoint: dict[str, Any], keys: list[str]
) -> None:
    """Load the objects whose state cannot be checked beforehand (schedulers, user objects, the
    precision plugin) first, undoing them all if any one fails, so that nothing stays half-loaded.

    ``state`` maps keys to the live objects, ``checkpoint`` keys to what was saved; only ``keys`` load.
    """
    targets: list[tuple[str, Stateful, Any]] = [
        (key, state[key], checkpoint[key])
        for key in keys
        if isinstance(state[key], Stateful) and not isinstance(state[key], (nn.Module, Optimizer))
    ]
    if PRECISION_STATE_KEY in checkpoint:
        targets.insert(0, (PRECISION_STATE_KEY, precision, checkpoint[PRECISION_STATE_KEY]))
    loaded: list[tuple[Stateful, dict[str, Any]]] = []
    for key, target, saved in targets:
        backup = copy.deepcopy(target.state_dict())
        try:
            target.load_state_dict(saved)
        except Exception as error:
            target.load_state_dict(backup)
            for earlier, earlier_backup in reversed(loaded):
                earlier.load_state_dict(earlier_backup)
            raise CheckpointError(
                f"Entry {key!r} of {path!s} could not be loaded into {type(target).__name__}: "
                f"{type(error).__name__}: {str(error).rstrip('.')}. Nothing was changed."
            ) from error
        loaded.append((target, backup))


def _filtered(checkpoint: dict[str, Any], filter: Mapping[str, CheckpointFilter]) -> dict[str, Any]:
    """``checkpoint`` with the state dicts named in ``filter`` reduced to the items their function keeps."""
    result = dict(checkpoint)
    for key, keep in filter.items():
        entry = checkpoint[key]
        if not isinstance(entry, Mapping):
            raise ValueError(
                f"filter[{key!r}] selects items of a state dict, but state[{key!r}] is not one (type "
                f"{type(entry).__name__}); filter only the entries of modules, optimizers, stateful objects and dicts."
            )
        result[key] = {name: value for name, value in entry.items() if keep(name, value)}
    return result


def parameters_with_grad(optimizer: Optimizer) -> list[torch.Tensor]:
    """The parameters of ``optimizer`` that hold a gradient."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
