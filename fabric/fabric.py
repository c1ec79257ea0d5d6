"""The ``Fabric`` object: the few calls a user adds to their own PyTorch loop.

``Fabric(...)`` resolves its choices once (:mod:`fabric.connector`), then every method delegates to
the strategy, which owns the accelerator, the precision plugin and checkpoint I/O.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
import weakref
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar, overload

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from fabric.accelerators.accelerator import Accelerator
from fabric.connector import AcceleratorArg, Plugin, PrecisionArg, StrategyArg, resolve
from fabric.plugins.io.checkpoint_io import PathType, StorageOptions
from fabric.plugins.io.formats import CheckpointFormat, recognise
from fabric.plugins.io.huggingface import DEFAULT_MAX_FILE_BYTES
from fabric.plugins.precision.precision import Precision
from fabric.strategies.huggingface_checkpoint import check_supported, load_huggingface, save_huggingface
from fabric.strategies.strategy import CheckpointFilter, Strategy
from fabric.utilities.apply_func import as_list, move_data_to_device, optimizer_to_device
from fabric.utilities.compile import CompileArg, Compiler, compiler_for, uncompiled
from fabric.utilities.device_parser import DevicesArg
from fabric.utilities.distributed import ReduceOp, parse_reduce_op
from fabric.utilities.interactive import is_interactive
from fabric.utilities.metrics_gather import gather_unpadded
from fabric.utilities.processes.exit import prepare_fast_shutdown, register_cleanup
from fabric.utilities.processes.workers import RankOwnedWorker
from fabric.utilities.profiler import TraceProfiler
from fabric.utilities.rank_zero import rank_zero_warn, set_global_rank
from fabric.utilities.replaced_parameters import ReplacedParameters
from fabric.utilities.seed import seed_everything, seeds_workers, worker_init_function
from fabric.wrappers import (
    FabricDataLoader,
    FabricModule,
    FabricOptimizer,
    unwrap_optimizer,
    wrap_dataloader,
    wrap_optimizer,
)

if TYPE_CHECKING:
    from fabric.loggers.logger import Logger

T = TypeVar("T")


class Fabric:
    """Device placement, mixed precision, distributed execution and checkpoints for your own loop.

    Args:
        accelerator: ``"cpu"``, ``"cuda"`` (or ``"gpu"``), ``"mps"``, ``"auto"``, or an ``Accelerator``.
        strategy: a registered name (``"single_device"``, ``"ddp"``, ...), ``"auto"``, or a ``Strategy``.
        devices: how many devices (int), which ones (list or ``"0,1"``), ``-1`` for all, or ``"auto"``.
        num_nodes: how many machines take part.
        precision: ``"32-true"`` (default), ``"64-true"``, ``"16-mixed"``, ``"bf16-mixed"``, ``"fp8-mixed"``
            (float8 matmuls on torchao), ``"16-true"``, ``"bf16-true"`` or a short form (``32``, ``16``, ``"bf16"``,
            ``"fp8"``, ``64``).
        plugins: a ``Precision`` and/or a ``CheckpointIO`` object.
        callbacks: objects whose methods :meth:`call` invokes by name.
        loggers: :class:`~fabric.loggers.Logger` objects that :meth:`log` and :meth:`log_dict` write to.
    """

    def __init__(
        self,
        accelerator: AcceleratorArg = "auto",
        strategy: StrategyArg = "auto",
        devices: DevicesArg = "auto",
        num_nodes: int = 1,
        precision: PrecisionArg = None,
        plugins: Sequence[Plugin] | Plugin | None = None,
        callbacks: Any | Sequence[Any] | None = None,
        loggers: Logger | Sequence[Logger] | None = None,
    ) -> None:
        self._resolved = resolve(
            accelerator=accelerator,
            strategy=strategy,
            devices=devices,
            num_nodes=num_nodes,
            precision=precision,
            plugins=plugins,
            interactive=is_interactive(),
        )
        self._strategy: Strategy = self._resolved.strategy
        self._callbacks: list[Any] = as_list(callbacks)
        self._loggers: list[Logger] = as_list(loggers)
        self._logs_saved_at_exit = False
        self._launched = False
        self._wrapped_modules: weakref.WeakSet[FabricModule] = weakref.WeakSet()
        self._replaced_parameters = ReplacedParameters()
        if not self._strategy.needs_launch:
            # One process, or processes a launcher (torchrun, srun, the CLI) already started: join now.
            self._setup_environment()

    # --- properties -------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """The device this process computes on."""
        return self._strategy.root_device

    @property
    def global_rank(self) -> int:
        return self._strategy.global_rank

    @property
    def local_rank(self) -> int:
        return self._strategy.local_rank

    @property
    def node_rank(self) -> int:
        return self._strategy.node_rank

    @property
    def world_size(self) -> int:
        return self._strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        return self._strategy.is_global_zero

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    @property
    def precision(self) -> Precision:
        return self._strategy.precision

    @property
    def _precision(self) -> Precision:
        """Lightning Fabric's private name for the precision plugin, which litgpt reads (``generate/tp.py``,
        ``LLM.distribute``: ``fabric._precision.convert_module(model)``)."""
        return self._strategy.precision

    @property
    def accelerator(self) -> Accelerator:
        """The accelerator (CPU, CUDA, MPS) this job runs on."""
        return self._strategy.accelerator

    @property
    def launched(self) -> bool:
        """Whether ``launch()`` has run in this process (every collective and ``setup`` needs it first when
        the strategy starts processes)."""
        return self._launched

    @property
    def loggers(self) -> list[Logger]:
        return list(self._loggers)

    @loggers.setter
    def loggers(self, loggers: Logger | Sequence[Logger] | None) -> None:
        """Replace the loggers :meth:`log` writes to (a Trainer adds its route to its destinations this way)."""
        self._loggers = as_list(loggers)

    @property
    def logger(self) -> Logger:
        """The first logger; an error if there is none."""
        if not self._loggers:
            raise AttributeError("This Fabric has no logger. Pass one with Fabric(loggers=...).")
        return self._loggers[0]

    # --- launching --------------------------------------------------------------------------------

    def launch(self, function: Callable[..., T] | None = None, *args: Any, **kwargs: Any) -> T | None:
        """Start the job's other processes if Fabric has to, then run ``function`` (if given) in each.

        ``function`` is called as ``function(fabric, *args, **kwargs)``; rank 0's return value is returned.
        When a launcher (torchrun, srun, ``fabric run model``) started the processes, or there is only
        one, nothing needs starting. Calling ``launch()`` again is a no-op.
        """
        if self._launched or not self._strategy.needs_launch:
            self._launched = True
            return function(self, *args, **kwargs) if function is not None else None
        launcher = self._strategy.launcher
        assert launcher is not None, "a strategy that needs a launch has a launcher"
        if function is None and launcher.runs_only_the_function:
            raise TypeError(
                f"fabric.launch() needs a function here: {type(self._strategy).__name__} spawns or forks its "
                "processes (strategy='ddp_spawn', 'ddp_fork', 'ddp_notebook', ...), and they run only the function "
                "given to launch(), not the rest of the script. Call fabric.launch(train), where train(fabric, *args) "
                "holds the training code, or use strategy='ddp', which runs the whole script in every process."
            )
        if is_interactive() and not launcher.is_interactive_compatible:
            raise RuntimeError(
                f"strategy={type(self._strategy).__name__} re-runs your script in new processes, which a notebook, "
                "REPL, `python -c` or `python - < script.py` cannot do. Use strategy='ddp_notebook' (or "
                "'ddp_fork') here, or run the script from a file."
            )
        self._launched = True
        return launcher.launch(self._run_launched, function, *args, **kwargs)  # type: ignore[no-any-return]

    def _run_launched(self, function: Callable[..., T] | None, *args: Any, **kwargs: Any) -> T | None:
        """What each launched process runs: join the job, then the user's function."""
        self._setup_environment()
        return function(self, *args, **kwargs) if function is not None else None

    def _setup_environment(self) -> None:
        self._strategy.setup_environment()
        set_global_rank(self._strategy.global_rank)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # At any world size: DeepSpeed, and DDP or FSDP on one device, hold a process group too.
            register_cleanup(self._end_distributed_job)

    def _end_distributed_job(self) -> None:
        """At process exit: release the process group completely.

        Dropping the strategy wrappers (e.g. DDP, which holds the group) before interpreter shutdown is
        what keeps gloo from aborting the process after the work is done (see ``process_exit``). No
        barrier first: a rank that exits early (``sys.exit``) must not wait for the others, and a peer's
        last collective has already received this rank's data when this rank's copy of it returned.
        """
        # torch-workaround(gloo-shutdown-abort): gloo aborts at shutdown while a DDP module holds the group
        for module in list(self._wrapped_modules):
            module.release_strategy_wrapper()
        self._strategy.teardown()
        prepare_fast_shutdown()  # collects the released group and wrappers, then makes finalisation cheap

    def _check_launched(self) -> None:
        if self._strategy.needs_launch and not self._launched:
            raise RuntimeError(
                f"{type(self._strategy).__name__} runs {self.world_size} processes: call `fabric.launch()` "
                "before setting up models, dataloaders or calling collectives."
            )

    # --- setup --------------------------------------------------------------------------------------

    @overload
    def setup(self, module: nn.Module, *, move_to_device: bool = True, compile: CompileArg = None) -> FabricModule: ...

    @overload
    def setup(
        self,
        module: nn.Module,
        *optimizers: Optimizer,
        scheduler: LRScheduler | None = None,
        move_to_device: bool = True,
        compile: CompileArg = None,
    ) -> tuple[Any, ...]: ...

    def setup(
        self,
        module: nn.Module,
        *optimizers: Optimizer,
        scheduler: LRScheduler | None = None,
        move_to_device: bool = True,
        compile: CompileArg = None,
    ) -> Any:
        """Prepare a module (and its optimizers) for the strategy and precision.

        Returns the wrapped module, or ``(module, *optimizers)`` when optimizers are given, and
        ``(module, *optimizers, scheduler)`` with a ``scheduler`` of one of them (as Lightning: DeepSpeed's
        engine then steps it after every optimizer step; other strategies return it as it is). A module
        compiled with ``torch.compile`` is taken apart and compiled again, with the same settings, around the
        strategy's wrapper (DDP, FSDP hooks stay outside the graph); ``compile=True`` or a dict of
        ``torch.compile`` arguments compiles a module that is not compiled yet the same way.
        """
        self._check_launched()
        module, compiler = self._uncompiled(module, compile)
        self._check_not_set_up(module, optimizers)
        _check_scheduler(scheduler, optimizers)
        module = self._prepare_module(module, move_to_device)
        for optimizer in optimizers:
            self._replaced_parameters.repoint(optimizer)
            if move_to_device:
                optimizer_to_device(optimizer, self.device)
        forward_module, set_up_optimizers = self._strategy.setup_module_and_optimizers(module, optimizers, scheduler)
        wrapped_module = self._wrap_set_up_module(forward_module, module, compiler)
        wrapped_optimizers = [wrap_optimizer(opt, self._strategy) for opt in set_up_optimizers]
        if scheduler is not None:
            return wrapped_module, *wrapped_optimizers, scheduler
        return (wrapped_module, *wrapped_optimizers) if optimizers else wrapped_module

    def setup_module(self, module: nn.Module, move_to_device: bool = True, compile: CompileArg = None) -> FabricModule:
        """Like :meth:`setup` for a module alone (optimizers are set up separately, e.g. for FSDP)."""
        self._check_launched()
        module, compiler = self._uncompiled(module, compile)
        self._check_not_set_up(module, ())
        module = self._prepare_module(module, move_to_device)
        return self._wrap_set_up_module(self._strategy.setup_module(module), module, compiler)

    @staticmethod
    def _uncompiled(module: nn.Module, compile: CompileArg) -> tuple[nn.Module, Compiler | None]:
        """The module to set up, and how to compile the strategy's wrapper around it (if at all)."""
        original, compiler = uncompiled(module)
        requested = compiler_for(compile)
        if compiler is not None and requested is not None:
            raise ValueError(
                f"compile={compile!r} was passed with a module torch.compile already compiled; pass one or the other."
            )
        return original, compiler or requested

    def setup_optimizers(self, *optimizers: Optimizer) -> Any:
        """Wrap optimizers so their ``step`` goes through the strategy. Returns one or a tuple."""
        self._check_launched()
        self._check_not_set_up(None, optimizers)
        for optimizer in optimizers:
            self._replaced_parameters.repoint(optimizer)
        wrapped = [wrap_optimizer(self._strategy.setup_optimizer(opt), self._strategy) for opt in optimizers]
        return wrapped[0] if len(wrapped) == 1 else tuple(wrapped)

    def mark_forward_method(self, module: FabricModule, method: str | Callable[..., Any]) -> None:
        """Run ``module.<method>(...)`` like ``module(...)``: through the strategy's wrapper (DDP synchronises
        its gradients, FSDP gathers the parameters) and under the precision.

        Needed for any method other than ``forward`` that runs the model, e.g. ``model.training_step(batch)``;
        under DDP, FSDP and DeepSpeed an unmarked one raises instead of training wrongly.
        """
        if not isinstance(module, FabricModule):
            raise TypeError(
                f"mark_forward_method() needs the module returned by fabric.setup(); got an un-set-up "
                f"{type(module).__name__}. Call `model = fabric.setup(model)` first."
            )
        module.mark_forward_method(method)

    def _prepare_module(self, module: nn.Module, move_to_device: bool) -> nn.Module:
        self._strategy.guard_uninitialised(module)
        before = dict(module.named_parameters())
        module = self._strategy.precision.convert_module(module)
        self._replaced_parameters.record(before, module)
        if move_to_device:
            self._strategy.module_to_device(module)
        return module

    def _wrap_set_up_module(
        self, forward_module: nn.Module, original_module: nn.Module, compiler: Compiler | None = None
    ) -> FabricModule:
        if compiler is not None:
            forward_module = compiler(forward_module)
        wrapped = FabricModule(forward_module, self._strategy, original_module=original_module)
        self._wrapped_modules.add(wrapped)
        return wrapped

    @staticmethod
    def _check_not_set_up(module: nn.Module | None, optimizers: Sequence[Optimizer]) -> None:
        if isinstance(module, FabricModule):
            raise ValueError("This module was already set up with Fabric; set up each module once.")
        if not isinstance(module, (nn.Module, type(None))):
            raise TypeError(f"setup() expects an nn.Module, got {type(module).__name__}.")
        for optimizer in optimizers:
            if isinstance(optimizer, FabricOptimizer):
                raise ValueError("This optimizer was already set up with Fabric; set up each optimizer once.")
            if not isinstance(optimizer, Optimizer):
                raise TypeError(f"setup() expects torch.optim.Optimizer objects, got {type(optimizer).__name__}.")

    @overload
    def setup_dataloaders(
        self, dataloader: DataLoader[Any], /, *, use_distributed_sampler: bool = True, move_to_device: bool = True
    ) -> DataLoader[Any]: ...

    @overload
    def setup_dataloaders(
        self, *dataloaders: DataLoader[Any], use_distributed_sampler: bool = True, move_to_device: bool = True
    ) -> list[DataLoader[Any]]: ...

    def setup_dataloaders(
        self, *dataloaders: DataLoader[Any], use_distributed_sampler: bool = True, move_to_device: bool = True
    ) -> DataLoader[Any] | list[DataLoader[Any]]:
        """Shard (in distributed strategies) and wrap dataloaders so batches arrive on the device.

        Each returned loader is still an instance of the user's ``DataLoader`` class. With
        ``use_distributed_sampler=False`` the sampler is left alone (the data is then not sharded). After
        ``seed_everything(workers=True)``, loaders without a ``worker_init_fn`` get one that seeds each worker
        of each rank differently. Worker processes take SIGTERM only from their rank and die with it
        (:mod:`fabric.utilities.processes.workers`): a scheduler's SIGTERM to the whole job is the rank's to handle.
        """
        if not dataloaders:
            raise ValueError("setup_dataloaders() needs at least one dataloader.")
        self._check_launched()
        wrapped = []
        for dataloader in dataloaders:
            if isinstance(dataloader, FabricDataLoader):
                raise ValueError("This dataloader was already set up with Fabric; set up each dataloader once.")
            processed = dataloader
            if use_distributed_sampler and isinstance(dataloader, DataLoader):
                processed = self._strategy.process_dataloader(dataloader)
            # A loader left as it is (not re-sharded) shares its state with the returned one: its own
            # state_dict() follows the iteration (a streaming loader's position).
            loader = wrap_dataloader(processed, self.device if move_to_device else None, processed is dataloader)
            if seeds_workers() and loader.worker_init_fn is None:
                loader.worker_init_fn = functools.partial(worker_init_function, rank=self.global_rank)
            if loader.num_workers > 0:
                loader.worker_init_fn = RankOwnedWorker(loader.worker_init_fn)
            wrapped.append(loader)
        return wrapped[0] if len(wrapped) == 1 else wrapped

    # --- the training step ------------------------------------------------------------------------

    def backward(self, tensor: torch.Tensor, *args: Any, model: FabricModule | None = None, **kwargs: Any) -> None:
        """Replace ``loss.backward()``: applies loss scaling and strategy-specific backward logic."""
        strategy = self._strategy
        module = model._forward_call if isinstance(model, FabricModule) else model  # a plain attribute: per step
        if args or kwargs:
            strategy.backward(tensor, module, *args, **kwargs)
        elif strategy.backward_is_plain and strategy.precision.backward_is_plain:
            # Neither changes the backward (decided per call: the Trainer may swap the precision): two calls shorter.
            tensor.backward()  # type: ignore[no-untyped-call]
        else:  # forwarding empty ``*args, **kwargs`` would cost about as much as the rest of this method
            strategy.backward(tensor, module)

    def clip_gradients(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        clip_val: float | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor | None:
        """Clip gradients by value (``clip_val``) or by total norm (``max_norm``; returns the norm).

        Gradients are unscaled first when a GradScaler is in use, so thresholds mean true values.
        """
        if (clip_val is None) == (max_norm is None):
            raise ValueError(
                f"clip_gradients() needs exactly one of clip_val or max_norm; got clip_val={clip_val}, "
                f"max_norm={max_norm}."
            )
        original_module = _unwrap_module(module)
        original_optimizer = unwrap_optimizer(optimizer)
        if max_norm is not None:
            return self._strategy.clip_gradients_norm(
                original_module,
                original_optimizer,
                max_norm,
                norm_type=norm_type,
                error_if_nonfinite=error_if_nonfinite,
            )
        assert clip_val is not None
        self._strategy.clip_gradients_value(original_module, original_optimizer, clip_val)
        return None

    def autocast(self) -> AbstractContextManager[Any]:
        """The precision's forward context, for code that runs outside a set-up module's forward."""
        return self._strategy.precision.forward_context()

    def no_backward_sync(self, module: FabricModule, enabled: bool = True) -> AbstractContextManager[Any]:
        """Skip gradient synchronisation during gradient accumulation (a no-op with one process)."""
        if not isinstance(module, FabricModule):
            raise TypeError(
                "no_backward_sync() needs the module returned by fabric.setup(); "
                f"got an un-set-up {type(module).__name__}. Call `model = fabric.setup(model)` first."
            )
        return self._strategy.no_backward_sync(module._forward_module, enabled)

    def context_parallel(
        self,
        buffers: Sequence[torch.Tensor],
        seq_dims: Sequence[int],
        no_restore: Sequence[torch.Tensor] = (),
    ) -> AbstractContextManager[None]:
        """Split the sequence of each of ``buffers`` (its dimension ``seq_dims[i]``) over the mesh's
        ``context_parallel`` ranks inside the context, forward, loss and backward run in it; the buffers are
        restored on exit, except those in ``no_restore``. Nothing happens on a mesh without context parallelism::

            with fabric.context_parallel([tokens, targets], seq_dims=[1, 1], no_restore=[tokens, targets]):
                loss = loss_fn(model(tokens), targets)  # this rank's part of the sequence
                fabric.backward(loss)
        """
        return self._strategy.context_parallel(buffers, seq_dims, no_restore)

    def init_module(self, empty_init: bool | None = None) -> AbstractContextManager[Any]:
        """Build a module directly on the device and in the precision's dtype.

        ``empty_init=True`` skips weight initialisation: only use it when a checkpoint is loaded next. The
        set-up module refuses to run (naming the tensors) until ``load`` or ``load_raw`` filled what was skipped.
        """
        return self._strategy.module_init_context(empty_init)

    def sharded_model(self) -> AbstractContextManager[Any]:
        """Lightning's deprecated name for :meth:`init_module` (which this is, with a ``FutureWarning`` naming it)."""
        warnings.warn(
            "fabric.sharded_model() is deprecated: use fabric.init_module(), which builds the module the same way.",
            FutureWarning,
            stacklevel=2,
        )
        return self.init_module()

    def init_tensor(self) -> AbstractContextManager[Any]:
        """Create tensors directly on the device and in the precision's dtype."""
        return self._strategy.tensor_init_context()

    def to_device(self, obj: T) -> T:
        """Move a module, a tensor, or every tensor in a collection to this process's device."""
        if isinstance(obj, nn.Module):
            self._strategy.module_to_device(obj)
            return obj
        return move_data_to_device(obj, self.device)  # type: ignore[no-any-return]

    def profiler(self, folder: str | os.PathLike[str], **options: Any) -> TraceProfiler:
        """A ``torch.profiler`` on a schedule writing this rank's Chrome traces to ``folder`` (see ``TraceProfiler``).

        ``options``: ``wait``, ``warmup``, ``active``, ``repeat``, ``skip_first`` (in ``step()`` calls),
        ``filename`` (``{rank}``, ``{batch}``), ``record_shapes``, ``profile_memory``, ``with_stack``, ``with_flops``.
        """
        return TraceProfiler(folder, rank=self.global_rank, **options)

    # --- collectives ------------------------------------------------------------------------------

    def barrier(self, name: str | None = None) -> None:
        """Wait until every process reaches this point."""
        self._check_launched()
        self._strategy.barrier(name=name)

    def broadcast(self, obj: T, src: int = 0) -> T:
        """Send ``obj`` (a tensor or any picklable object) from rank ``src`` to every process."""
        self._check_launched()
        return self._strategy.broadcast(obj, src=src)  # type: ignore[no-any-return]

    def all_gather(self, data: Any, sync_grads: bool = False) -> Any:
        """Gather tensors (or every tensor in a collection) into shape ``(world_size, ...)``.

        Tensors whose first dimension differs across ranks come back as a list of one tensor per rank.
        """
        self._check_launched()
        return apply_to_collection(
            data,
            (torch.Tensor, int, float),
            lambda t: self._strategy.all_gather(_as_tensor(t, self.device), sync_grads),
        )

    def gather_for_metrics(self, data: Any, dataloader: DataLoader[Any]) -> Any:
        """Gather per-sample results from every rank without the samples the sampler repeated.

        ``DistributedSampler`` repeats a few samples so that every rank gets as many; ``all_gather`` would
        count them twice (101 samples over 2 ranks give 102 rows). Pass tensors (or a collection) whose
        first dimension is one row per sample of ``dataloader`` (as set up by :meth:`setup_dataloaders`),
        per batch or for a whole pass at once; the rows of all ranks come back concatenated in sample
        order, the repeats cut off (101 rows).
        """
        self._check_launched()
        return gather_unpadded(data, dataloader, self.all_gather)

    def all_reduce(self, data: Any, reduce_op: ReduceOp = "mean") -> Any:
        """Reduce tensors (or numbers, or every tensor in a collection) across processes."""
        parse_reduce_op(reduce_op)
        self._check_launched()
        return apply_to_collection(
            data, (torch.Tensor, int, float), lambda t: self._strategy.all_reduce(_as_tensor(t, self.device), reduce_op)
        )

    @contextlib.contextmanager
    def rank_zero_first(self, local: bool = False) -> Generator[None, None, None]:
        """Let rank 0 (per node with ``local=True``) run the block first, e.g. to download data once."""
        rank = self.local_rank if local else self.global_rank
        if rank > 0:
            self.barrier("rank_zero_first")
        yield
        if rank == 0:
            self.barrier("rank_zero_first")

    # --- checkpoints ------------------------------------------------------------------------------

    def save(
        self,
        path: PathType,
        state: dict[str, Any],
        filter: Mapping[str, CheckpointFilter] | None = None,
        *,
        storage_options: StorageOptions = None,
        async_save: bool = False,
        format: str | None = None,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    ) -> Future[None]:
        """Save modules, optimizers and any other state (a dict) to a local path or fsspec URL.

        The write is atomic: a crash while saving leaves any previous file at ``path`` intact.
        ``filter={"model": fn}`` saves only the items of ``state["model"]``'s state dict for which
        ``fn(name, value)`` is True, e.g. ``lambda name, _: "lora_" in name`` (one-file checkpoints only).
        ``storage_options`` go to fsspec for a URL, e.g. ``{"client_kwargs": {"endpoint_url": ...}}`` for
        an S3-compatible store (MinIO, on-premises S3); by default fsspec reads the environment.

        ``async_save=True`` returns once a CPU copy of the state is taken; the copy is written on a background
        thread while training goes on. At most one save is in flight: the next save or load waits for it, and
        raises its error. The returned future completes when the checkpoint is complete at ``path`` (on every
        rank for sharded strategies). Synchronous saves return a future that is already complete.

        ``format="huggingface"`` writes ``state={"model": model}``'s weights as a folder in Hugging Face's layout
        (``model-0000i-of-0000N.safetensors`` of at most ``max_file_bytes`` each, the index, and a ``transformers``
        model's ``config.json``) that ``from_pretrained`` reads, every rank writing only its shards (any strategy but
        DeepSpeed). At an object store URL every rank uploads the weight files it owns (no rank holds the
        model), and rank 0 the index, last. With ``async_save=True`` (to a folder on a file system) each rank's
        shards are copied to CPU memory and written on the save thread, as above.
        """
        if format is not None:
            return self._save_in_format(format, path, state, filter, async_save, max_file_bytes, storage_options)
        self._check_launched()
        _check_filter(filter, state)
        self._strategy.background_saves.wait()  # one save in flight at a time; its error is raised here
        written = self._strategy.save_checkpoint(
            path, _unwrap_objects(state), filter=filter, storage_options=storage_options, async_save=async_save
        )
        self.barrier("save")
        return written

    def _save_in_format(
        self,
        format: str,
        path: PathType,
        state: dict[str, Any],
        filter: Mapping[str, CheckpointFilter] | None,
        async_save: bool,
        max_file_bytes: int,
        storage_options: StorageOptions,
    ) -> Future[None]:
        if format not in SAVE_FORMATS:
            raise ValueError(f"fabric.save(format={format!r}): accepted formats are {list(SAVE_FORMATS)} (or None).")
        if filter:
            raise ValueError(f"fabric.save(format={format!r}) takes no filter= (it writes the model's weights).")
        if max_file_bytes <= 0:
            raise ValueError(f"fabric.save(max_file_bytes={max_file_bytes}) must be positive.")
        module = _only_model(_unwrap_objects(state), f"fabric.save(format={format!r})")
        check_supported(self._strategy, "Saving")
        self._check_launched()
        self._strategy.background_saves.wait()
        return save_huggingface(
            self._strategy, path, module, max_file_bytes, storage_options=storage_options, async_save=async_save
        )

    def load(
        self,
        path: PathType,
        state: dict[str, Any] | None = None,
        strict: bool = True,
        *,
        weights_only: bool = True,
        storage_options: StorageOptions = None,
        key_mapping: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint written by :meth:`save` (a file, or a sharded or DeepSpeed directory), or a folder in
        Hugging Face's layout, on a disk or at a URL, into ``state={"model": model}`` (each rank reading only its
        shards; ``key_mapping`` renames the folder's tensors to the model's names, ``{regex: replacement}`` as in
        ``transformers``' ``from_pretrained``, the first matching pattern applied).

        With ``state``, its modules, optimizers and stateful objects are filled in place, plain values
        are replaced, and the entries not asked for are returned. Without it, the whole checkpoint is
        returned. ``weights_only=False`` allows arbitrary pickled objects: only for trusted files.
        ``storage_options`` go to fsspec for a URL, as in :meth:`save`.
        """
        unwrapped = None if state is None else _unwrap_objects(state)
        self._strategy.background_saves.wait()  # a save still being written is complete first
        form = recognise(path, storage_options)
        if key_mapping is not None and form is not CheckpointFormat.HUGGINGFACE:
            raise ValueError(
                f"fabric.load(key_mapping=...) renames the tensors of a Hugging Face folder; {os.fspath(path)!r} is "
                f"not one (a {form.value} checkpoint)."
            )
        if form is CheckpointFormat.HUGGINGFACE:
            module = _only_model(unwrapped, "Loading a Hugging Face folder")
            load_huggingface(self._strategy, path, module, strict, key_mapping, storage_options)
            self._strategy.module_loaded(module)
            self.barrier("load")
            return {}
        remainder = self._strategy.load_checkpoint(
            path, unwrapped, strict=strict, weights_only=weights_only, storage_options=storage_options
        )
        if state is not None and unwrapped is not None:
            for key, value in unwrapped.items():
                if isinstance(value, nn.Module):
                    self._strategy.module_loaded(value)
                elif not isinstance(value, Optimizer) and value is not _unwrap(state[key]):
                    state[key] = value
        self.barrier("load")
        return remainder

    def load_raw(
        self,
        path: PathType,
        obj: nn.Module | Optimizer,
        strict: bool = True,
        *,
        weights_only: bool = True,
        storage_options: StorageOptions = None,
    ) -> None:
        """Load a bare state dict (e.g. ``torch.save(model.state_dict(), path)``) into a module or optimizer."""
        target = _unwrap(obj)
        self._strategy.load_raw(path, target, strict=strict, weights_only=weights_only, storage_options=storage_options)
        if isinstance(target, nn.Module):
            self._strategy.module_loaded(target)

    # --- logging, callbacks, misc -----------------------------------------------------------------

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on local rank 0 only, so each machine shows a message once."""
        if self.local_rank == 0:
            print(*args, **kwargs)

    def log(self, name: str, value: Any, step: int | None = None) -> None:
        """Log one scalar to every logger (they write on rank 0 only)."""
        self.log_dict({name: value}, step=step)

    def log_dict(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log scalars to every logger (they write on rank 0 only).

        What a logger still buffers when the process ends is written then (``logger.save()`` at exit): a script that
        never calls ``finalize`` loses no row (Lightning's CSV logger drops up to its last 99).
        """
        metrics = apply_to_collection(metrics, torch.Tensor, lambda t: t.item() if t.numel() == 1 else t)
        for logger in self._loggers:
            logger.log_metrics(metrics, step=step)
        if not self._logs_saved_at_exit:
            self._logs_saved_at_exit = True
            register_cleanup(functools.partial(_save_logs, tuple(self._loggers)))  # the loggers, not this Fabric

    def call(self, hook_name: str, *args: Any, **kwargs: Any) -> None:
        """Call ``hook_name(*args, **kwargs)`` on every callback that defines it, in order."""
        for callback in self._callbacks:
            method = getattr(callback, hook_name, None)
            if method is None:
                continue
            if not callable(method):
                rank_zero_warn(f"{type(callback).__name__}.{hook_name} is not callable; skipped.")
                continue
            method(*args, **kwargs)

    @staticmethod
    def seed_everything(seed: int | None = None, workers: bool = True, verbose: bool = True) -> int:
        """Seed ``random``, NumPy and torch, and (unless ``workers=False``) each dataloader worker of each rank
        distinctly, as Lightning Fabric does; see :func:`fabric.utilities.seed.seed_everything`."""
        return seed_everything(seed, workers, verbose)

    def __getstate__(self) -> dict[str, Any]:
        # Spawned ranks receive a pickled copy; modules set up here are not theirs to track.
        return {**self.__dict__, "_wrapped_modules": None, "_replaced_parameters": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._wrapped_modules = weakref.WeakSet()
        self._replaced_parameters = ReplacedParameters()

    def __repr__(self) -> str:
        resolved = self._resolved
        return (
            f"Fabric(accelerator={resolved.accelerator!r}, strategy={type(self._strategy).__name__}, "
            f"devices={len(resolved.devices)}, num_nodes={resolved.num_nodes}, precision={resolved.precision.name!r})"
        )


def _save_logs(loggers: Sequence[Logger]) -> None:
    for logger in loggers:
        logger.save()


#: The ``format=`` values of :meth:`Fabric.save` (None: Fabric's own checkpoint).
SAVE_FORMATS = ("huggingface",)


def _only_model(state: dict[str, Any] | None, action: str) -> nn.Module:
    """The one module of ``state``: Hugging Face folders hold one model's weights, nothing else."""
    if state is None or len(state) != 1 or not isinstance(next(iter(state.values())), nn.Module):
        described = "no state" if state is None else f"state with keys {sorted(state)}"
        raise ValueError(f"{action} takes state={{'model': model}}, one module; got {described}.")
    module: nn.Module = next(iter(state.values()))
    return module


def _check_filter(filter: Mapping[str, CheckpointFilter] | None, state: dict[str, Any]) -> None:
    if filter is None:
        return
    if not isinstance(filter, Mapping):
        raise TypeError(f"filter must be a dict of state keys to (name, value) -> bool functions, got {filter!r}.")
    unknown = sorted(set(filter) - set(state))
    if unknown:
        raise ValueError(f"filter names {unknown}, which are not in the state; its keys are {sorted(state)}.")
    for key, function in filter.items():
        if not callable(function):
            raise TypeError(f"filter[{key!r}] must be a (name, value) -> bool function, got {function!r}.")


def _check_scheduler(scheduler: LRScheduler | None, optimizers: Sequence[Optimizer]) -> None:
    """``setup(..., scheduler=)`` takes a learning-rate scheduler of one of the optimizers set up with it."""
    if scheduler is None:
        return
    if not isinstance(scheduler, LRScheduler):
        raise TypeError(f"setup(scheduler=...) expects a torch.optim.lr_scheduler.LRScheduler, got {scheduler!r}.")
    if not any(scheduler.optimizer is optimizer for optimizer in optimizers):
        raise ValueError(
            f"setup(scheduler={type(scheduler).__name__}(...)) needs the optimizer it schedules in the same call: "
            "fabric.setup(model, optimizer, scheduler=scheduler)."
        )


def _as_tensor(value: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.tensor(value, device=device)


def _unwrap_module(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, FabricModule) else module


def _unwrap(obj: Any) -> Any:
    if isinstance(obj, nn.Module):
        obj, _ = uncompiled(obj)
    if isinstance(obj, FabricModule):
        return obj.module
    if isinstance(obj, FabricOptimizer):
        return obj.optimizer
    return obj


def _unwrap_objects(state: dict[str, Any]) -> dict[str, Any]:
    return {key: _unwrap(value) for key, value in state.items()}
