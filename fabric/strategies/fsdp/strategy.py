"""Fully sharded data parallel (FSDP2): each rank keeps only its shard of parameters, gradients and
optimizer state, and gathers a layer's full parameters just for its forward and backward.

Built on ``torch.distributed.fsdp.fully_shard``; parameters become ``DTensor`` shards. Runs on CUDA
(NCCL) and on CPU (gloo). Checkpoints are sharded directories by default (see
:mod:`fabric.strategies.fsdp.checkpoint`). Lightning Fabric's arguments are translated by
:mod:`fabric.strategies.fsdp.options`.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Generator, Iterable, Mapping
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any, Literal, cast, get_args

import torch
import torch.distributed
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffload,
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer
from typing_extensions import override

import fabric.strategies.fsdp.checkpoint as checkpoints
from fabric.plugins.io.checkpoint_io import PathType, StorageOptions
from fabric.plugins.io.formats import CheckpointFormat, recognise
from fabric.plugins.precision.dtypes import mixed_dtype
from fabric.strategies.fsdp.activation_checkpointing import checkpoint_activations
from fabric.strategies.fsdp.options import (
    ShardPolicy,
    UnitsLikeFsdp1,
    check_mesh_agrees,
    resolve_settings,
    shard_units,
)
from fabric.strategies.mesh import AUTO, DATA_PARALLEL_DIMS, MeshPlan
from fabric.strategies.parallel import ParallelStrategy, split_common_arguments
from fabric.strategies.strategy import CheckpointFilter
from fabric.utilities.cli_contract import CLI_MESH
from fabric.utilities.grad_norm import clip_grad_norm_
from fabric.utilities.init import DeferredContexts

StateDictType = Literal["sharded", "full"]
STATE_DICT_TYPES: tuple[StateDictType, ...] = get_args(StateDictType)


def _check_policy(name: str, policy: Any, allow_callable: bool) -> None:
    if policy is None or isinstance(policy, UnitsLikeFsdp1):  # translated from Lightning's auto_wrap_policy
        return
    if allow_callable and callable(policy) and not isinstance(policy, type):
        return
    if isinstance(policy, (set, frozenset, list, tuple)) and all(
        isinstance(cls, type) and issubclass(cls, nn.Module) for cls in policy
    ):
        return
    accepted = "a set of nn.Module classes" + (" or a callable (module) -> bool" if allow_callable else "")
    raise ValueError(f"{name}={policy!r} is not valid. Accepted: {accepted}, or None.")


class FSDPStrategy(ParallelStrategy):
    """Shards the model over the ranks with ``fully_shard`` and shards the data like DDP.

    Args:
        shard_modules: the submodules that become their own FSDP unit (gathered and freed one at a
            time, which is what bounds memory), as a set of layer classes or a ``(module) -> bool``
            predicate. The root module is always sharded; by default it is the only unit.
        reshard_after_forward: ``True`` (the default) frees gathered parameters after each unit's forward
            (ZeRO-3); ``False`` keeps them until the backward (ZeRO-2: more memory, one all-gather less). The
            root's are kept either way, as torch's default and FSDP1 do: the backward begins with them.
        cpu_offload: keep shards, gradients and the optimizer step in CPU memory (accelerators only);
            FSDP1's ``CPUOffload(offload_params=...)`` is accepted too.
        activation_checkpointing: layer classes whose activations are recomputed in the backward.
        mesh: the data-parallel shape, a :class:`~fabric.strategies.mesh.MeshPlan` (or ``(replicate, shard)``):
            ``MeshPlan(data_parallel_replicate=2, data_parallel=4)`` shards over groups of 4 ranks and keeps 2
            replicas (HSDP of any shape, whatever the nodes). By default every rank shards.
        hybrid_shard: shard within each node and replicate across nodes (HSDP with a replica per node:
            ``MeshPlan(data_parallel_replicate=num_nodes)``).
        replicate_only: shard nothing: every rank holds whole parameters and gradients are all-reduced
            (``MeshPlan(data_parallel_replicate="auto", data_parallel=1)``; FSDP1's ``NO_SHARD``).
        state_dict_type: ``"sharded"`` saves a directory of per-rank shards (DCP); ``"full"`` saves one
            ``torch.save`` file gathered on rank 0.
        mixed_precision: FSDP2's ``MixedPrecisionPolicy`` (or FSDP1's ``MixedPrecision`` without
            ``buffer_dtype``), used instead of the one the precision plugin implies.
        sync_module_states: broadcast every parameter and buffer from rank 0 before sharding, so ranks
            that initialised the model differently start equal (a meta-device model has nothing to send).
        **kwargs: the common arguments of every parallel strategy
            (:class:`~fabric.strategies.parallel.ParallelArgs`: ``timeout``, ``process_group_backend``, ...),
            and Lightning Fabric's: ``auto_wrap_policy``, ``sharding_strategy``, ``device_mesh=(replicate, shard)``,
            ``activation_checkpointing_policy``, ``use_orig_params=True``, ``limit_all_gathers=True``;
            translated to the settings above, or refused with a ``ValueError`` naming what to use instead
            (:mod:`fabric.strategies.fsdp.options`). Giving one with the own argument it sets is refused.
    """

    def __init__(
        self,
        *,
        shard_modules: ShardPolicy | None = None,
        reshard_after_forward: bool | None = None,
        cpu_offload: bool | CPUOffload = False,
        activation_checkpointing: set[type[nn.Module]] | None = None,
        hybrid_shard: bool | None = None,
        replicate_only: bool | None = None,
        state_dict_type: StateDictType = "sharded",
        mixed_precision: MixedPrecisionPolicy | MixedPrecision | None = None,
        sync_module_states: bool = False,
        mesh: MeshPlan | tuple[int, int] | None = None,
        **kwargs: Any,
    ) -> None:
        own = {
            "shard_modules": shard_modules,
            "reshard_after_forward": reshard_after_forward,
            "cpu_offload": cpu_offload,
            "activation_checkpointing": activation_checkpointing,
            "hybrid_shard": hybrid_shard,
            "replicate_only": replicate_only,
            "mixed_precision": mixed_precision,
            "mesh": mesh,
        }
        common, lightning_options = split_common_arguments(kwargs)
        settings = resolve_settings(own, lightning_options)
        _check_policy("shard_modules", settings.shard_modules, allow_callable=True)
        _check_policy("activation_checkpointing", settings.activation_checkpointing, allow_callable=False)
        if not isinstance(sync_module_states, bool):
            raise ValueError(f"sync_module_states={sync_module_states!r} is not valid. Accepted: True or False.")
        if state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(f"state_dict_type={state_dict_type!r} is not valid. Accepted: {list(STATE_DICT_TYPES)}.")
        super().__init__(**common)
        self.shard_modules = settings.shard_modules
        self.reshard_after_forward = settings.reshard_after_forward
        self.cpu_offload = settings.cpu_offload
        self.activation_checkpointing = set(settings.activation_checkpointing or ())
        self.hybrid_shard = settings.hybrid_shard
        self.replicate_only = settings.replicate_only
        self.mixed_precision = settings.mixed_precision
        self.mesh_plan_given = settings.mesh
        self.sync_module_states = sync_module_states
        self.state_dict_type: StateDictType = state_dict_type
        self._mesh: DeviceMesh | None = None
        # Original parameter -> its sharded replacement, so optimizers built before setup can be re-pointed.
        self._replacements: dict[int, tuple[weakref.ref[nn.Parameter], nn.Parameter]] = {}
        # Original parameters the set-up left to other ranks (other pipeline stages): dropped from optimizers.
        self._held_elsewhere: dict[int, weakref.ref[nn.Parameter]] = {}
        self._set_up_modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    # --- configuration -------------------------------------------------------------------------------

    @override
    def configuration_error(self) -> str | None:
        own_error = super().configuration_error()
        if own_error is not None:
            return own_error
        if self.cpu_offload and self.accelerator.device_type == "cpu":
            return (
                "FSDPStrategy(cpu_offload=True) ('fsdp_cpu_offload') moves shards to CPU memory between uses, "
                "which needs an accelerator; with accelerator='cpu' they already live there. Use strategy='fsdp'."
            )
        try:
            self.mesh_plan()
        except ValueError as error:
            return f"{type(self).__name__}: {error}"
        return None

    @override
    def configure_mesh(self, plan: MeshPlan) -> None:
        """Take ``plan`` (from ``fabric run model --mesh``) unless the strategy was given another mesh."""
        given = self.mesh_plan_given
        if given is not None and given != plan:
            raise ValueError(
                f"{type(self).__name__}(mesh={given.as_text()}) conflicts with the CLI's --mesh={plan.as_text()} "
                f"({CLI_MESH}). Remove one of the two."
            )
        self._check_mesh(plan)
        self.mesh_plan_given = plan

    def _check_mesh(self, plan: MeshPlan) -> None:
        check_mesh_agrees(plan, self.replicate_only)

    def planned_mesh(self) -> MeshPlan:
        """The mesh the settings ask for, before the world size fills in its ``"auto"`` degree."""
        if self.mesh_plan_given is not None:
            return self.mesh_plan_given
        if self.hybrid_shard:
            return MeshPlan(data_parallel_replicate=self.num_nodes)
        if self.replicate_only:
            return MeshPlan(data_parallel_replicate=AUTO, data_parallel=1)
        return MeshPlan()

    def mesh_plan(self) -> MeshPlan:
        """The resolved mesh: every degree a number, their product the world size."""
        return self.planned_mesh().resolve(self.world_size)

    @override
    def checkpoint_io_refusal(self) -> str | None:
        if self.state_dict_type == "full":
            return None
        return (
            f"{type(self).__name__}(state_dict_type='sharded') writes each rank's shard with "
            "torch.distributed.checkpoint, not through a CheckpointIO plugin, which would be ignored. Remove the "
            "plugin, or pass state_dict_type='full' to save one file through it."
        )

    @property
    def mesh(self) -> DeviceMesh:
        """The device mesh parameters are sharded over (built when the process group is joined)."""
        if self._mesh is None:
            raise RuntimeError("FSDPStrategy has no device mesh yet: call fabric.launch() first.")
        return self._mesh

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._mesh = self.mesh_plan().build(self.root_device.type)

    @property
    def data_parallel_mesh(self) -> DeviceMesh:
        """What ``fully_shard`` shards over: ``mesh["data_parallel"]``, or with replicas (HSDP) the 2-D
        ``mesh["data_parallel_replicate", "data_parallel"]``."""
        if self.mesh_plan().data_parallel_replicate == 1:
            return self.mesh["data_parallel"]
        return self.mesh[DATA_PARALLEL_DIMS]

    @property
    @override
    def data_parallel_shard(self) -> tuple[int, int]:
        """Split over replicate x shard: the ranks of one tensor-parallel (or pipeline) group share their batches."""
        plan = self.mesh_plan()
        return plan.data_parallel_size, plan.data_parallel_index(self.global_rank)

    # --- modules -------------------------------------------------------------------------------------

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager[Any]:
        """With ``empty_init=True`` modules are built on the meta device (no memory); ``setup`` shards them
        and then materialises only this rank's shards."""
        if not empty_init:
            return super().module_init_context(empty_init)
        return DeferredContexts(lambda: torch.device("meta"), self.precision.module_init_context)

    @override
    def module_to_device(self, module: nn.Module) -> None:
        if not _has_meta_tensors(module):  # meta modules are materialised shard by shard in setup_module
            super().module_to_device(module)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` (see :meth:`_shard`) and materialise a meta module; with ``sync_module_states``
        rank 0's parameters and buffers are broadcast first."""
        originals = dict(module.named_parameters())
        if self.sync_module_states and not _has_meta_tensors(module):
            self._broadcast_module_states(module)
        module = self._shard(module)
        uninitialised = self._materialise(module)
        if uninitialised:
            reason = "belong to modules without reset_parameters(), so nothing initialised them"
            self.refuse_forward_until_loaded(module, uninitialised, reason)
        sharded = dict(module.named_parameters())
        for name, original in originals.items():
            if name in sharded:
                self._replacements[id(original)] = (weakref.ref(original), sharded[name])
            else:
                self._held_elsewhere[id(original)] = weakref.ref(original)
        self._set_up_modules.add(module)
        return module

    def _broadcast_module_states(self, module: nn.Module) -> None:
        """Overwrite every parameter and buffer with rank 0's (``torch.distributed.broadcast``, one per tensor)."""
        with torch.no_grad():
            for tensor in (*module.parameters(), *module.buffers()):
                if tensor.device == self.root_device:
                    torch.distributed.broadcast(tensor.detach(), src=0)
                else:  # e.g. setup(move_to_device=False): NCCL sends only from the accelerator
                    sent = tensor.detach().to(self.root_device)
                    torch.distributed.broadcast(sent, src=0)
                    tensor.copy_(sent)

    def _shard_options(self, mesh: DeviceMesh) -> dict[str, Any]:
        """``fully_shard``'s options from this strategy's settings, over ``mesh``."""
        return {
            "mesh": mesh,
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": self.mixed_precision_policy(),
            "offload_policy": CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy(),
        }

    def _shard(self, module: nn.Module) -> nn.Module:
        """Apply activation checkpointing, then ``fully_shard`` in place: sub-units first, then the root."""
        for submodule in module.modules():
            if isinstance(submodule, tuple(self.activation_checkpointing)):
                checkpoint_activations(submodule)
        options = self._shard_options(self.data_parallel_mesh)
        units = shard_units(self.shard_modules, module)
        for submodule in reversed(list(module.modules())):  # descendants before their ancestors
            if submodule in units:
                fully_shard(submodule, **options)
        # A root's gathered parameters are the first the backward needs: torch's default (None: False for the root
        # at run time, as FSDP1 did) keeps them after its forward, rather than gathering them again at once. A
        # forward without gradients has no backward to follow: it frees them (else an evaluation would leave them
        # gathered, and registered in place of the shards the optimizer and a save refer to).
        keeps_root = self.reshard_after_forward is True
        root_options = options | {"reshard_after_forward": None} if keeps_root else options
        for root in self._shard_roots(module):
            fully_shard(root, **root_options)
            if keeps_root:
                root.register_forward_hook(_reshard_without_gradients)
        return module

    def _shard_roots(self, module: nn.Module) -> list[nn.Module]:
        """The modules ``fully_shard`` makes roots of ``module``'s remaining parameters: ``module`` itself."""
        return [module]

    def mixed_precision_policy(self) -> MixedPrecisionPolicy:
        """The ``mixed_precision`` given, else from the precision plugin: ``*-mixed`` gathers parameters in
        half precision and reduces gradients in float32; ``*-true`` modules are already converted, so FSDP
        casts nothing."""
        if self.mixed_precision is not None:
            return self.mixed_precision
        param_dtype = mixed_dtype(self.precision.name)
        if param_dtype is None:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)

    def _materialise(self, module: nn.Module) -> list[str]:
        """Allocate this rank's shards of a meta module and initialise each submodule: with the ``param_init_fn``
        of its nearest ancestor (itself included) that has one (Composer's and llm-foundry's convention, e.g. MPT's
        configured init), else with its ``reset_parameters()``.

        Returns the names of tensors nothing initialised (their module has neither).
        """
        if not _has_meta_tensors(module):
            return []
        for root in self._shard_roots(module):  # through each FSDP root, which re-points its shards
            root.to_empty(device=self.root_device)
        initialised: set[str] = set()
        init_fns = {
            name: init_fn
            for name, owner in module.named_modules()
            if callable(init_fn := getattr(owner, "param_init_fn", None))
        }
        with torch.no_grad():
            for prefix, submodule in module.named_modules():
                init_fn = _nearest(init_fns, prefix)
                reset = getattr(submodule, "reset_parameters", None)
                if init_fn is not None:
                    reset = functools.partial(init_fn, submodule)
                if callable(reset):
                    if self.root_device.type == "cpu":
                        # torch-workaround(dtensor-cpu-mesh-rng): every rank draws the same shard on a CPU mesh
                        _reset_on_full_tensors(submodule, reset)
                    else:
                        reset()  # DTensor's RNG tracker draws each shard as its part of the full tensor
                    local = [*submodule.named_parameters(recurse=False), *submodule.named_buffers(recurse=False)]
                    initialised.update(f"{prefix}.{name}" if prefix else name for name, _ in local)
        tensors = [*module.named_parameters(), *module.named_buffers()]
        return [name for name, _ in tensors if name not in initialised]

    # --- optimizers ----------------------------------------------------------------------------------

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Re-point an optimizer built from the original parameters at their sharded replacements (and drop
        those another rank holds: other pipeline stages' parameters)."""
        if not any(isinstance(p, DTensor) for p in _optimizer_parameters(optimizer)) and optimizer.state:
            raise ValueError(
                "This optimizer has already stepped on unsharded parameters; its state cannot be moved onto the "
                "shards. Call fabric.setup(model, optimizer) before training."
            )
        for group in optimizer.param_groups:
            kept = (parameter for parameter in group["params"] if not self._is_held_elsewhere(parameter))
            group["params"] = [self._sharded(parameter) for parameter in kept]
        return optimizer

    def _is_held_elsewhere(self, parameter: torch.Tensor) -> bool:
        original = self._held_elsewhere.get(id(parameter))
        return original is not None and original() is parameter

    def _sharded(self, parameter: torch.Tensor) -> torch.Tensor:
        if isinstance(parameter, DTensor):
            return parameter
        original, sharded = self._replacements.get(id(parameter), (None, None))
        if original is None or original() is not parameter or sharded is None:
            raise ValueError(
                f"The optimizer holds a parameter of shape {tuple(parameter.shape)} that belongs to no module set "
                "up with FSDPStrategy. Set up the model first (fabric.setup(model, optimizer) does) and build the "
                "optimizer from the parameters of the module it returns."
            )
        return sharded

    def owner_of(self, optimizer: Optimizer) -> nn.Module:
        """The set-up module whose sharded parameters ``optimizer`` updates (needed for its state dict)."""
        parameters = {id(p) for p in _optimizer_parameters(optimizer)}
        for module in self._set_up_modules:
            if any(id(p) in parameters for p in module.parameters()):
                return module
        raise ValueError(
            f"{type(optimizer).__name__} updates no module set up with FSDPStrategy; set both up with fabric.setup()."
        )

    # --- the step ------------------------------------------------------------------------------------

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager[Any]:
        """Accumulate unreduced gradients locally (``set_requires_gradient_sync(False)``) inside the context."""
        if enabled and isinstance(module, FSDPModule):
            return _gradient_sync_disabled(module)
        return contextlib.nullcontext()

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip by the norm over all ranks' shards (parameters on different meshes too, see
        :mod:`fabric.utilities.grad_norm`, and other pipeline stages'); returned as a plain tensor, the same on every
        rank."""
        self.precision.unscale_gradients(optimizer)
        error_if_nonfinite = error_if_nonfinite and not self.precision.skips_non_finite_steps
        parameters = _optimizer_parameters(optimizer)
        across = self._ranks_with_other_parameters()
        return clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, across=across)

    def _ranks_with_other_parameters(self) -> ProcessGroup | None:
        """A group whose ranks hold parameters this rank does not (pipeline stages), or None: every rank holds a
        shard of every parameter."""
        return None

    # --- checkpoints -----------------------------------------------------------------------------------

    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The full (unsharded) state dict, gathered on rank 0 (other ranks get an empty dict)."""
        return checkpoints.full_module_state(module)

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The full optimizer state in ``optimizer.state_dict()`` form, gathered on rank 0."""
        return checkpoints.full_optimizer_state(self.owner_of(optimizer), optimizer)

    @override
    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        checkpoints.load_full_module_state(module, state_dict, strict)

    @override
    def load_optimizer_state_dict(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
        checkpoints.load_full_optimizer_state(self.owner_of(optimizer), optimizer, state_dict)

    @property
    @override
    def saves_on_every_rank(self) -> bool:
        return self.state_dict_type == "sharded"

    @override
    def save_checkpoint(
        self,
        path: PathType,
        state: dict[str, Any],
        filter: Mapping[str, CheckpointFilter] | None = None,
        storage_options: StorageOptions = None,
        async_save: bool = False,
    ) -> Future[None]:
        """A sharded directory by default; one full file with ``state_dict_type="full"`` (``filter`` only there)."""
        if self.state_dict_type == "full":
            return super().save_checkpoint(path, state, filter, storage_options, async_save)
        if filter:
            raise ValueError(
                "fabric.save(filter=...) writes a subset of full state dicts into one file; FSDPStrategy saves a "
                "sharded directory here. Use FSDPStrategy(state_dict_type='full') to save filtered checkpoints."
            )
        background = (self.background_saves, self.background_group()) if async_save else None
        return checkpoints.save_sharded(path, state, self.owner_of, self.precision, self, storage_options, background)

    @override
    def load_checkpoint(
        self,
        path: PathType,
        state: dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool = True,
        storage_options: StorageOptions = None,
    ) -> dict[str, Any]:
        """Load a sharded directory (any number of ranks saved it) or a full file into the sharded objects."""
        if state is not None and recognise(path, storage_options) is CheckpointFormat.DCP:
            return checkpoints.load_sharded(
                path,
                state,
                self.owner_of,
                self.precision,
                strict=strict,
                weights_only=weights_only,
                storage_options=storage_options,
            )
        return super().load_checkpoint(path, state, strict, weights_only, storage_options)

    def __repr__(self) -> str:
        return (
            f"FSDPStrategy(devices={len(self._parallel_devices or [])}, state_dict_type={self.state_dict_type!r}, "
            f"cpu_offload={self.cpu_offload}, mesh={self.planned_mesh().describe()})"
        )


def _reset_on_full_tensors(module: nn.Module, reset: Any) -> None:
    """Run ``reset`` on full-size copies of ``module``'s own sharded tensors, and keep this rank's slice of each.

    DTensor's random operators follow the shards only on CUDA-like meshes. On a CPU mesh each rank drew its shard
    from its own generator, and with the same seed every rank drew the same numbers: ``Linear(4, 8)`` over 2 ranks
    came out with rows 4..7 equal to rows 0..3 (torch only warned, "DTensor random operators may not have complete
    support on cpu device mesh"). Drawing the whole tensor on every rank (same seed) and slicing it gives each rank
    its part of one tensor, as one process would have drawn it; only one module's tensors are full at a time.
    """
    slots = [("_parameters", name) for name, value in module._parameters.items() if isinstance(value, DTensor)]
    slots += [("_buffers", name) for name, value in module._buffers.items() if isinstance(value, DTensor)]
    sharded: dict[tuple[str, str], DTensor] = {}
    for table, name in slots:
        tensor = getattr(module, table)[name]
        sharded[(table, name)] = tensor
        full = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.to_local().device)
        getattr(module, table)[name] = nn.Parameter(full, tensor.requires_grad) if table == "_parameters" else full
    try:
        reset()
        drawn = {slot: getattr(module, slot[0])[slot[1]] for slot in sharded}
    finally:
        for (table, name), tensor in sharded.items():
            getattr(module, table)[name] = tensor
    for slot, tensor in sharded.items():
        mine = distribute_tensor(drawn[slot].detach(), tensor.device_mesh, tensor.placements, src_data_rank=None)
        tensor.to_local().copy_(mine.to_local())


def _nearest(init_fns: dict[str, Callable[[nn.Module], None]], name: str) -> Callable[[nn.Module], None] | None:
    """The ``param_init_fn`` of the module ``name`` or of its nearest ancestor that has one (by qualified name)."""
    while True:
        if name in init_fns:
            return init_fns[name]
        if not name:
            return None
        name = name.rpartition(".")[0]


def _has_meta_tensors(module: nn.Module) -> bool:
    return any(tensor.is_meta for tensor in (*module.parameters(), *module.buffers()))


def _optimizer_parameters(optimizer: Optimizer) -> Iterable[torch.Tensor]:
    return (parameter for group in optimizer.param_groups for parameter in group["params"])


@contextlib.contextmanager
def _gradient_sync_disabled(module: FSDPModule) -> Generator[None, None, None]:
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def _reshard_without_gradients(module: nn.Module, inputs: Any, output: Any) -> None:
    """After a root's forward under ``torch.no_grad()`` (or inference mode): free its gathered parameters."""
    if not torch.is_grad_enabled():
        cast(FSDPModule, module).reshard()
