"""DeepSpeed ZeRO: optimizer state (stage 1), gradients (2) and parameters (3) sharded across ranks.

``fabric.setup(model, optimizer)`` builds one DeepSpeed engine from the model and its optimizer; from
then on ``fabric.backward`` is ``engine.backward`` and ``optimizer.step()`` is ``engine.step()``. The
``deepspeed`` package (extra ``[deepspeed]``) is imported only when this strategy is built.

Behaviour a user relies on:

- Gradient accumulation is the loop's: gradients add up over ``fabric.backward`` calls until
  ``optimizer.step()`` (the config gets ``managed_gradient_accumulation: false``). Under stages 0 and 1
  gradients are reduced only in ``step()``, so ``fabric.no_backward_sync`` has nothing to skip; under
  stages 2 and 3 every backward reduce-scatters, which ZeRO's partitioning needs and which cannot be
  skipped. ``no_backward_sync`` is therefore accepted and changes nothing; the results are correct.
- Gradient clipping is DeepSpeed's: set ``"gradient_clipping": <max norm>`` in the config;
  ``fabric.clip_gradients`` raises.
- Checkpoints are directories in DeepSpeed's sharded layout (see :mod:`fabric.plugins.io.deepspeed_checkpoint`).
  Loading needs the world size they were saved with; :func:`convert_zero_checkpoint_to_fp32` turns one
  into a single file that a single-device Fabric loads.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from torch.utils.data import DataLoader
from typing_extensions import Unpack, override

from fabric.plugins.io import deepspeed_checkpoint as checkpoints
from fabric.plugins.io.background_saves import finished
from fabric.plugins.io.checkpoint_io import PathType, StorageOptions
from fabric.plugins.io.deepspeed_safe_load import safe_loading
from fabric.plugins.io.storage import is_remote
from fabric.strategies.deepspeed.config import (
    ConfigArg,
    check_stage,
    complete_config,
    precision_from_config,
    read_config,
    with_micro_batch_size,
    zero_stage,
)
from fabric.strategies.deepspeed.precision import DeepSpeedPrecision
from fabric.strategies.parallel import ParallelArgs, ParallelStrategy
from fabric.strategies.strategy import CheckpointFilter, entries_to_load, load_unvalidated_state
from fabric.utilities.checkpoint_state import Stateful, loaded_value, rebuilt_loaders
from fabric.utilities.exceptions import CheckpointError
from fabric.utilities.init import DeferredContexts
from fabric.utilities.lazy import install_hint
from fabric.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

#: The release this integration is tested with; older ones lack ``managed_gradient_accumulation``.
MIN_DEEPSPEED_VERSION = (0, 19, 8)


class DeepSpeedStrategy(ParallelStrategy):
    """Trains through DeepSpeed engines, one process per device (``fabric.launch()`` re-runs the script).

    Args:
        config: a DeepSpeed config dict or the path of a JSON file. Fabric fills in what it leaves out
            and raises if it contradicts Fabric's settings (see :mod:`fabric.strategies.deepspeed.config`).
        stage: the ZeRO stage (0-3); ``None`` takes it from the config, else 2.
        offload_optimizer: keep optimizer state (and the optimizer step) on the CPU (stage 2 or 3).
        offload_parameters: keep parameters on the CPU between uses (stage 3).
        **common: the arguments of every parallel strategy (:class:`~fabric.strategies.parallel.ParallelArgs`);
            a ``checkpoint_io`` is refused when Fabric is built, as DeepSpeed saves through its engine.
    """

    huggingface_refusal = (
        "DeepSpeed's engine holds the parameters (its float32 masters in ZeRO's partitions); save a DeepSpeed "
        "checkpoint, then write its weights as a Hugging Face folder in one process: fabric consolidate CHECKPOINT "
        "--format huggingface."
    )

    def __init__(
        self,
        *,
        config: ConfigArg = None,
        stage: int | None = None,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        **common: Unpack[ParallelArgs],
    ) -> None:
        check_stage(stage)
        super().__init__(**common)
        self._user_config = read_config(config)
        self.stage = stage
        self.offload_optimizer = offload_optimizer
        self.offload_parameters = offload_parameters
        self._config: dict[str, Any] | None = None
        self._batch_size: int | None = None
        self._engines: list[tuple[nn.Module, Optimizer | None, DeepSpeedEngine]] = []
        # Engines that step a scheduler from setup(): its step count after the engine's last step.
        self._scheduler_epochs: dict[DeepSpeedEngine, int] = {}

    @override
    def _connected(self) -> None:
        """Settle the config against Fabric's precision and world size, so a conflict fails now."""
        self._config = complete_config(
            self._user_config,
            stage=self.stage,
            offload_optimizer=self.offload_optimizer,
            offload_parameters=self.offload_parameters,
            precision=self.precision.name,
            world_size=self.world_size,
        )
        self.precision = DeepSpeedPrecision(self.precision.name, device_type=self.accelerator.device_type)

    @property
    def config(self) -> dict[str, Any]:
        """The config DeepSpeed receives (Fabric's settings filled in)."""
        if self._config is None:
            raise RuntimeError("DeepSpeedStrategy has no config yet; it must be set up through Fabric.")
        return with_micro_batch_size(self._config, self._batch_size)

    @property
    def zero_stage(self) -> int:
        return zero_stage(self.config)

    @property
    @override
    def engine_handles_gradients(self) -> bool:
        return True

    @override
    def setup_environment(self) -> None:
        """Join the process group, then hand it to DeepSpeed's communication layer.

        DeepSpeed reads this process's ranks from the environment (``deepspeed.zero.Init`` needs
        ``LOCAL_RANK``), which rank 0 of a job Fabric launched itself does not have: export them.
        """
        deepspeed = _import_deepspeed(self.parallel_devices[0].type)
        super().setup_environment()
        for name, value in (
            ("RANK", self.global_rank),
            ("LOCAL_RANK", self.local_rank),
            ("WORLD_SIZE", self.world_size),
        ):
            os.environ.setdefault(name, str(value))
        deepspeed.init_distributed(self.process_group_backend, dist_init_required=False, timeout=self.timeout)

    # --- modules and optimizers -------------------------------------------------------------------

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: Sequence[Optimizer], scheduler: LRScheduler | None = None
    ) -> tuple[nn.Module, list[Optimizer]]:
        """One engine from the module, its optimizer and its learning-rate scheduler, which the engine then
        steps after every optimizer step; the user keeps (a wrapper of) their optimizer and the scheduler."""
        if len(optimizers) > 1:
            raise ValueError(
                f"DeepSpeed trains a model with exactly one optimizer, got {len(optimizers)}. Combine the parameter "
                "groups into one optimizer, or set up each model with its own optimizer."
            )
        if isinstance(scheduler, ReduceLROnPlateau):
            raise ValueError(
                "DeepSpeed steps the scheduler given to setup(..., scheduler=) without a metric, which "
                "ReduceLROnPlateau needs: leave it out of setup() and call scheduler.step(metric) yourself."
            )
        optimizer = optimizers[0] if optimizers else None
        engine = self._initialize(module, optimizer, scheduler)
        if scheduler is not None:
            self._scheduler_epochs[engine] = scheduler.last_epoch
        return engine, list(optimizers)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """An engine without an optimizer (for evaluation); train with ``fabric.setup(model, optimizer)``."""
        engine: nn.Module = self._initialize(module, None)
        return engine

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        raise ValueError(
            "DeepSpeed builds one engine from a model and its optimizer: set them up together with "
            "`model, optimizer = fabric.setup(model, optimizer)` instead of setup_module()/setup_optimizers()."
        )

    def _initialize(
        self, module: nn.Module, optimizer: Optimizer | None, scheduler: LRScheduler | None = None
    ) -> DeepSpeedEngine:
        deepspeed = _import_deepspeed(self.root_device.type)
        engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler, config=self.config)
        self._engines.append((module, optimizer, engine))
        return engine

    @override
    def module_to_device(self, module: nn.Module) -> None:
        """Under ZeRO-3 the engine places the (partitioned) parameters itself."""
        if self.zero_stage != 3:
            super().module_to_device(module)

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager[Any]:
        """Under ZeRO-3, ``deepspeed.zero.Init`` partitions each parameter as soon as it is created."""
        context = super().module_init_context(empty_init)
        if self.zero_stage != 3:
            return context
        if not dist.is_initialized():
            raise RuntimeError("ZeRO-3 builds modules already partitioned: call fabric.launch() before init_module().")
        deepspeed = _import_deepspeed(self.root_device.type)
        assert isinstance(context, DeferredContexts)
        context.add(lambda: deepspeed.zero.Init(config_dict_or_path=self.config))
        return context

    @override
    def process_dataloader(self, dataloader: DataLoader[Any]) -> DataLoader[Any]:
        """Shard like DDP; the batch size also becomes DeepSpeed's micro batch size unless configured."""
        self._batch_size = dataloader.batch_size
        return super().process_dataloader(dataloader)

    # --- the step -----------------------------------------------------------------------------------

    @override
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        engine = self._engine(module=module) if module is not None else self._only_engine()
        self.backward_in_progress = True
        try:
            self._exchanging_gradients(engine.backward, tensor, *args, **kwargs)
        finally:
            self.backward_in_progress = False

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        if closure is not None:
            raise ValueError(
                "DeepSpeed steps through its engine, which takes no optimizer closure; call the closure yourself "
                "before optimizer.step()."
            )
        engine = self._engine(optimizer=optimizer)
        self._check_scheduler_not_stepped_twice(engine)
        result = engine.step()
        if engine in self._scheduler_epochs:
            self._scheduler_epochs[engine] = engine.lr_scheduler.last_epoch
        return result

    def _check_scheduler_not_stepped_twice(self, engine: DeepSpeedEngine) -> None:
        """Warn when the user also steps the scheduler the engine steps: its schedule would run ahead."""
        expected = self._scheduler_epochs.get(engine)
        if expected is None or engine.lr_scheduler.last_epoch == expected:
            return
        rank_zero_warn(
            f"scheduler.step() was called outside optimizer.step() ({engine.lr_scheduler.last_epoch - expected} "
            "time(s) since the last one): DeepSpeed already steps the scheduler given to fabric.setup(..., "
            "scheduler=) after every optimizer step, so its schedule runs ahead. Remove your scheduler.step() call."
        )

    @override
    def optimizer_zero_grad(self, optimizer: Optimizer, set_to_none: bool = True) -> None:
        """Through DeepSpeed's optimizer: the torch optimizer's groups now hold DeepSpeed's flat float32
        partitions, whose gradient buffers (kept across steps when offloading) must not be dropped."""
        self._engine(optimizer=optimizer).optimizer.zero_grad(set_to_none=set_to_none)

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        raise RuntimeError(
            f"DeepSpeed clips gradients inside engine.step(): remove fabric.clip_gradients(max_norm={max_norm}) and "
            f"set 'gradient_clipping': {max_norm} in the DeepSpeed config instead."
        )

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float) -> None:
        raise RuntimeError(
            "DeepSpeed does not clip gradients by value; clip by norm with 'gradient_clipping' in its config."
        )

    @override
    def module_state_dict(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """Full tensors on every rank, also under ZeRO-3, where each rank holds only a partition of each parameter.

        Under stage 3 this is a collective: every rank must call ``model.state_dict()``. The parameters are
        gathered (``deepspeed.zero.GatheredParameters``), copied, and partitioned again, so the result costs
        the full model's memory on every rank. The values are the module's own (half precision under
        ``*-mixed``), not the optimizer's float32 master weights. ``fabric.save`` is unaffected (sharded).
        """
        if self.zero_stage != 3:
            return super().module_state_dict(module, *args, **kwargs)
        if kwargs.get("keep_vars") or (len(args) > 2 and args[2]):
            raise ValueError(
                "state_dict(keep_vars=True) is not available under ZeRO-3: the parameters hold only this rank's "
                "partition. Call state_dict() for full copies, or save with fabric.save() (sharded) and consolidate "
                "with fabric.strategies.deepspeed.convert_zero_checkpoint_to_fp32."
            )
        deepspeed = _import_deepspeed(self.root_device.type)
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            state = module.state_dict(*args, **kwargs)
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = value.detach().clone()
        return state

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's shard of the optimizer state, as DeepSpeed keeps it."""
        state: dict[str, Any] = self._engine(optimizer=optimizer).optimizer.state_dict()
        return state

    def _engine(self, *, module: nn.Module | None = None, optimizer: Optimizer | None = None) -> DeepSpeedEngine:
        for original, original_optimizer, engine in self._engines:
            if module is not None and module in (original, engine):
                return engine
            if optimizer is not None and optimizer is original_optimizer:
                return engine
        what = f"module {type(module).__name__}" if module is not None else f"optimizer {type(optimizer).__name__}"
        raise RuntimeError(f"The {what} was not set up with this DeepSpeedStrategy: call fabric.setup() first.")

    def _only_engine(self) -> DeepSpeedEngine:
        if len(self._engines) != 1:
            raise RuntimeError(
                f"{len(self._engines)} models are set up with DeepSpeed; say which one with "
                "fabric.backward(loss, model=model)."
            )
        return self._engines[0][2]

    # --- checkpoints ------------------------------------------------------------------------------

    @property
    @override
    def saves_on_every_rank(self) -> bool:
        return True

    @override
    def default_precision(self) -> str | None:
        """The precision the config enables (``fp16`` -> ``"16-mixed"``, ``bf16`` -> ``"bf16-mixed"``), as
        Composer reads a ``deepspeed_config``'s precision when the Trainer was given none."""
        return precision_from_config(self._user_config)

    @override
    def checkpoint_io_refusal(self) -> str | None:
        return (
            "DeepSpeedStrategy saves through the DeepSpeed engine's own checkpointing, not through a CheckpointIO "
            "plugin, which would be ignored. Remove the plugin."
        )

    @override
    def save_checkpoint(
        self,
        path: PathType,
        state: dict[str, Any],
        filter: Mapping[str, CheckpointFilter] | None = None,
        storage_options: StorageOptions = None,
        async_save: bool = False,
    ) -> Future[None]:
        """Every rank writes its shard with ``engine.save_checkpoint``; ``latest`` moves only when all are done."""
        if async_save:
            raise ValueError(
                "async_save=True needs a snapshot of the state to write in the background; DeepSpeed writes its "
                "engine's live state (engine.save_checkpoint). Save synchronously with DeepSpeedStrategy."
            )
        if filter:
            raise ValueError(
                "fabric.save(filter=...) writes a subset of full state dicts into one file; DeepSpeed saves the "
                "engine's shards whole. Save without a filter (convert_zero_checkpoint_to_fp32 makes one file)."
            )
        module_key, engine = self._engine_in(state)
        client_state = {
            key: self._state_of(value) for key, value in state.items() if not isinstance(value, (nn.Module, Optimizer))
        }
        client_state[checkpoints.MODULE_KEY_ENTRY] = module_key
        tag = self.broadcast(checkpoints.new_tag())
        save = functools.partial(
            engine.save_checkpoint, tag=tag, client_state={"fabric_client_state": client_state}, save_latest=False
        )
        if is_remote(path):
            with checkpoints.staging_directory() as staging:
                save(os.fspath(staging))
                checkpoints.upload(staging, tag, os.fspath(path), storage_options)
            self.barrier("deepspeed checkpoint uploads")
            commit = functools.partial(
                checkpoints.commit_remote, os.fspath(path), tag, self.world_size, storage_options
            )
        else:
            directory = Path(path)
            checkpoints.prepare_directory(directory)  # on every rank, so that a bad path fails everywhere at once
            save(os.fspath(directory))
            self.barrier("deepspeed checkpoint shards")
            commit = functools.partial(checkpoints.commit, directory, tag, self.world_size)
        error = None
        if self.is_global_zero:
            try:
                commit()
            except CheckpointError as refused:
                error = str(refused)
        error = self.broadcast(error)
        if error is not None:
            raise CheckpointError(error)
        return finished()

    @override
    def load_checkpoint(
        self,
        path: PathType,
        state: dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool = True,
        storage_options: StorageOptions = None,
    ) -> dict[str, Any]:
        """Fill the engine (and its optimizer, if ``state`` holds it) and the client entries in place.

        Everything that can be checked without loading (the directory, the world size, the client keys,
        under ``weights_only`` the classes every file names) is checked first. Under ``weights_only``
        every file, DeepSpeed's own reads included, is loaded with ``torch.load(weights_only=True)``.
        A checkpoint at a URL is downloaded to a temporary local directory first.
        """
        if state is None:
            raise ValueError(
                "Loading a DeepSpeed checkpoint needs the state to fill: fabric.load(path, {'model': model})."
            )
        module_key, engine = self._engine_in(state)
        with checkpoints.local_copy(path, storage_options) as directory:
            tag = checkpoints.latest_tag(directory)
            load_optimizer = any(isinstance(value, Optimizer) for value in state.values())
            if load_optimizer:
                checkpoints.check_world_size(directory, tag, self.world_size)
            with safe_loading(directory / tag, weights_only):
                client_state = checkpoints.read_client_state(directory, tag, weights_only)
                client_state.pop(checkpoints.MODULE_KEY_ENTRY, None)
                in_engine = [key for key, value in state.items() if key == module_key or isinstance(value, Optimizer)]
                keys = entries_to_load(path, state, [*client_state, *in_engine], strict)
                keys = [key for key in keys if key not in in_engine]
                for key in keys:
                    self._check_fits(state[key], client_state[key], strict, where=f"Entry {key!r} of {path!s}")
                loaded_path, _ = engine.load_checkpoint(
                    os.fspath(directory),
                    tag=tag,
                    load_module_strict=strict,
                    load_optimizer_states=load_optimizer,
                    load_lr_scheduler_states=False,
                )
        if loaded_path is None:
            raise CheckpointError(f"DeepSpeed could not load {path!s} (tag {tag!r}).")
        load_unvalidated_state(path, self.precision, state, client_state, keys)
        for key in keys:
            if not isinstance(state[key], Stateful):
                state[key] = loaded_value(state[key], client_state[key], weights_only)
        return rebuilt_loaders({key: value for key, value in client_state.items() if key not in state}, weights_only)

    def _engine_in(self, state: dict[str, Any]) -> tuple[str, DeepSpeedEngine]:
        modules = [(key, value) for key, value in state.items() if isinstance(value, nn.Module)]
        if len(modules) != 1:
            raise ValueError(
                f"A DeepSpeed checkpoint holds exactly one model set up with fabric.setup(); the state has "
                f"{len(modules)} modules ({[key for key, _ in modules]})."
            )
        key, module = modules[0]
        engine = self._engine(module=module)
        for other, value in state.items():
            if isinstance(value, Optimizer) and self._engine(optimizer=value) is not engine:
                raise ValueError(f"state[{other!r}] is not the optimizer set up with state[{key!r}].")
        return key, engine

    def __repr__(self) -> str:
        stage = self._config["zero_optimization"]["stage"] if self._config else self.stage
        return f"DeepSpeedStrategy(stage={stage}, devices={len(self._parallel_devices or [])})"


def convert_zero_checkpoint_to_fp32(checkpoint_dir: PathType, output_file: PathType, weights_only: bool = True) -> None:
    """Gather a sharded checkpoint into one file of full float32 weights plus the saved client entries.

    Runs in one process, without a process group (``deepspeed.utils.zero_to_fp32``). The file loads with a
    single-device Fabric: ``fabric.load(output_file, {"model": model, "step": 0})``. Optimizer state is not
    consolidated. Nothing in the checkpoint can run code unless ``weights_only=False`` (a trusted checkpoint).
    """
    _import_deepspeed(None)
    checkpoints.consolidate(checkpoint_dir, Path(output_file), weights_only)


_DEPRECATED_COLLECTIVES = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


def _import_deepspeed(device_type: str | None) -> Any:
    """Import ``deepspeed`` on first use, with a clear message when it is missing or too old.

    For a CPU job DeepSpeed is told to use its CPU accelerator, which it would not pick on a GPU machine.
    """
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # otherwise DeepSpeed picks CUDA on a GPU machine
    # ZeRO calls collectives that torch deprecates; the FutureWarning is DeepSpeed's to act on and came once per
    # call site on every rank (194 lines from examples/deepspeed_train.py --stage 3), burying the job's output.
    warnings.filterwarnings("ignore", message=_DEPRECATED_COLLECTIVES, category=FutureWarning)
    try:
        import deepspeed
    except ImportError as error:
        raise ImportError(
            f"strategy='deepspeed*' needs the deepspeed package: {install_hint('deepspeed', 'deepspeed')}."
        ) from error
    version = tuple(int(part) for part in deepspeed.__version__.split("+")[0].split(".")[:3])
    if version < MIN_DEEPSPEED_VERSION:
        wanted = ".".join(map(str, MIN_DEEPSPEED_VERSION))
        raise ImportError(f"DeepSpeedStrategy needs deepspeed>={wanted}, found {deepspeed.__version__}.")
    return deepspeed
