"""Model parallelism on the N-D device mesh: pipeline stages (:mod:`fabric.strategies.pipeline`), tensor parallelism
by the user's ``parallelize_fn``, FSDP2 (or HSDP) over the data-parallel dimensions.

The mesh is the one :class:`~fabric.strategies.mesh.MeshPlan` describes; Lightning's
``ModelParallelStrategy(data_parallel_size, tensor_parallel_size)`` is ``MeshPlan(data_parallel=...,
tensor_parallel=...)``. The user's ``parallelize_fn(model, device_mesh)`` splits layers over
``device_mesh["tensor_parallel"]`` (DTensor's ``parallelize_module`` with Colwise/Rowwise plans); the strategy then
shards the result with ``fully_shard`` over the data-parallel dimensions (``data_parallel``, with
``data_parallel_replicate`` when there are replicas), unless ``parallelize_fn`` applied ``fully_shard`` itself.
Data is split over the data-parallel dimensions only: the ranks of one tensor-parallel group (and of one pipeline)
read the same batches. With a :class:`~fabric.strategies.pipeline.PipelinePlan` each rank first keeps only its stage
of the model; ``parallelize_fn`` and FSDP then apply to that stage.

Everything after the sharding is :class:`~fabric.strategies.fsdp.FSDPStrategy`'s: optimizers built
before setup are re-pointed, meta-device models are materialised, and checkpoints are DCP directories
(:mod:`fabric.strategies.fsdp.checkpoint`) that load on any other mesh shape and in one process.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from fabric.plugins.io.checkpoint_io import PathType, StorageOptions
from fabric.strategies import context_parallel
from fabric.strategies.fsdp.options import ShardPolicy
from fabric.strategies.fsdp.strategy import FSDPStrategy, StateDictType
from fabric.strategies.mesh import AUTO, DATA_PARALLEL_DIMS, MeshPlan
from fabric.strategies.parallel import ParallelArgs, refuse_unexpected_arguments
from fabric.strategies.pipeline import (
    WHOLE_BACKWARD_SCHEDULES,
    PipelineModule,
    PipelinePlan,
    keep_stages,
    stage_parts,
    stage_view,
)
from fabric.strategies.same_batches import check_first_batch, refuse_different_batches
from fabric.strategies.strategy import CheckpointFilter

#: ``parallelize_fn(model, device_mesh) -> model``: applies tensor parallelism (and optionally FSDP) in place.
ParallelizeFn = Callable[[nn.Module, DeviceMesh], nn.Module]
MeshSize = int | Literal["auto"]


def _check_size(name: str, value: Any) -> None:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return
    raise ValueError(f"{name}={value!r} is not valid. Accepted: a positive int or 'auto'.")


def lightning_mesh(num_nodes: int, data_parallel_size: MeshSize, tensor_parallel_size: MeshSize) -> MeshPlan:
    """Lightning's two sizes as a plan. Both ``"auto"``: tensor parallelism within a node, data parallelism across
    nodes; one ``"auto"``: what the other leaves."""
    if data_parallel_size == AUTO and tensor_parallel_size == AUTO:
        data_parallel_size = num_nodes
    return MeshPlan(data_parallel=data_parallel_size, tensor_parallel=tensor_parallel_size)


class ModelParallelStrategy(FSDPStrategy):
    """Tensor parallelism by ``parallelize_fn`` on the N-D mesh, FSDP2 (or HSDP) on its data-parallel dimensions.

    Args:
        parallelize_fn: ``(model, device_mesh) -> model``; called once in ``fabric.setup`` with the
            mesh (see :mod:`fabric.strategies.mesh`). Typically calls
            ``parallelize_module(model, device_mesh["tensor_parallel"], plan)``.
            If it applies ``fully_shard`` itself, the strategy does not shard again.
        data_parallel_size: ranks that hold different data (FSDP shards over them); ``"auto"``: the
            number of nodes, or what ``tensor_parallel_size`` leaves.
        tensor_parallel_size: ranks that split each layer; ``"auto"``: the processes per node, or what
            ``data_parallel_size`` leaves.
        mesh: the whole mesh as a :class:`~fabric.strategies.mesh.MeshPlan` instead of the two sizes, e.g.
            ``MeshPlan(data_parallel_replicate=2, data_parallel=2, tensor_parallel=2)`` (HSDP x TP).
        pipeline: a :class:`~fabric.strategies.pipeline.PipelinePlan` for a mesh with ``pipeline_parallel`` above 1:
            where the model is cut into stages, the loss, the microbatches and the schedule. ``parallelize_fn`` is
            then optional (no tensor parallelism).
        reshard_after_forward, state_dict_type, shard_modules, activation_checkpointing, mixed_precision,
            sync_module_states: as in :class:`~fabric.strategies.fsdp.FSDPStrategy`, applied after
            ``parallelize_fn`` (unless it sharded itself). Under a zero-bubble schedule (``InterleavedZeroBubble``,
            ``ZBVZeroBubble``, ``DualPipeV``) the parameters stay gathered from the forward to the weights' backward:
            ``reshard_after_forward`` is ``False`` (``True`` is refused), for the FSDP units ``parallelize_fn``
            made too; ``activation_checkpointing`` recomputes a module for each of the two backwards.
        **common: the arguments of every parallel strategy (:class:`~fabric.strategies.parallel.ParallelArgs`);
            FSDPStrategy's Lightning names are not taken.
    """

    def __init__(
        self,
        parallelize_fn: ParallelizeFn | None = None,
        data_parallel_size: MeshSize = "auto",
        tensor_parallel_size: MeshSize = "auto",
        *,
        mesh: MeshPlan | None = None,
        pipeline: PipelinePlan | None = None,
        reshard_after_forward: bool | None = None,
        state_dict_type: StateDictType = "sharded",
        shard_modules: ShardPolicy | None = None,
        activation_checkpointing: set[type[nn.Module]] | None = None,
        mixed_precision: MixedPrecisionPolicy | None = None,
        sync_module_states: bool = False,
        **common: Unpack[ParallelArgs],
    ) -> None:
        if pipeline is not None and not isinstance(pipeline, PipelinePlan):
            raise ValueError(
                f"pipeline={pipeline!r} is not valid. Accepted: a fabric.strategies.PipelinePlan, or None."
            )
        splits_otherwise = pipeline is not None or (mesh is not None and mesh.context_parallel != 1)
        if not callable(parallelize_fn) and not (splits_otherwise and parallelize_fn is None):
            raise ValueError(
                f"ModelParallelStrategy needs parallelize_fn, a callable (model, device_mesh) -> model (or a "
                f"pipeline= plan, or a mesh with context_parallel); got {parallelize_fn!r}. Pass "
                "strategy=ModelParallelStrategy(parallelize_fn=...) instead of strategy='model_parallel'."
            )
        if pipeline is not None and state_dict_type == "full":
            raise ValueError(
                "ModelParallelStrategy(pipeline=..., state_dict_type='full') cannot gather one file on rank 0: each "
                "rank holds one stage. Keep state_dict_type='sharded' and join a save with `fabric consolidate`."
            )
        _check_size("data_parallel_size", data_parallel_size)
        _check_size("tensor_parallel_size", tensor_parallel_size)
        if mesh is not None and not isinstance(mesh, MeshPlan):
            raise ValueError(f"mesh={mesh!r} is not valid. Accepted: a fabric.strategies.MeshPlan, or None.")
        if mesh is not None and (data_parallel_size, tensor_parallel_size) != (AUTO, AUTO):
            raise ValueError(
                "ModelParallelStrategy got mesh= and data_parallel_size/tensor_parallel_size, which describe the same "
                "thing; give the degrees in the MeshPlan only."
            )
        if mesh is not None:
            _check_pipeline_dimension(mesh, pipeline)
        if pipeline is not None and pipeline.splits_backward:
            if reshard_after_forward:
                raise ValueError(
                    f"ModelParallelStrategy(reshard_after_forward=True) with PipelinePlan(schedule="
                    f"{pipeline.schedule!r}): the schedule computes the weights' gradients after the forward, from "
                    "the gathered parameters FSDP would have freed (torch then leaves them None or partial). Leave "
                    "reshard_after_forward unset (False under this schedule; as a sharding_strategy: SHARD_GRAD_OP or "
                    "_HYBRID_SHARD_ZERO2, not FULL_SHARD or HYBRID_SHARD) or pick a schedule of "
                    f"{list(WHOLE_BACKWARD_SCHEDULES)}."
                )
            reshard_after_forward = False
        refuse_unexpected_arguments(type(self), common)  # FSDPStrategy would take the others as Lightning's
        super().__init__(
            reshard_after_forward=reshard_after_forward,
            state_dict_type=state_dict_type,
            shard_modules=shard_modules,
            activation_checkpointing=activation_checkpointing,
            mixed_precision=mixed_precision,
            sync_module_states=sync_module_states,
            **common,
        )
        self.parallelize_fn = parallelize_fn
        self.data_parallel_size = data_parallel_size
        self.tensor_parallel_size = tensor_parallel_size
        self.mesh_plan_given = mesh
        self.pipeline: PipelinePlan | None = pipeline
        self._pipelines: weakref.WeakSet[PipelineModule] = weakref.WeakSet()
        #: A module cut to several pipeline stages on this rank -> one view per stage (each its own FSDP root).
        self._stage_views: weakref.WeakKeyDictionary[nn.Module, list[nn.Module]] = weakref.WeakKeyDictionary()
        self._context_batches_checked = False
        if pipeline is not None:
            self.huggingface_refusal = PIPELINE_REFUSALS["huggingface"]

    @override
    def _check_mesh(self, plan: MeshPlan) -> None:
        if (self.data_parallel_size, self.tensor_parallel_size) != (AUTO, AUTO):
            raise ValueError(
                f"ModelParallelStrategy(data_parallel_size={self.data_parallel_size!r}, tensor_parallel_size="
                f"{self.tensor_parallel_size!r}) conflicts with the CLI's --mesh={plan.as_text()}. Remove one of them."
            )
        _check_pipeline_dimension(plan, self.pipeline)

    @override
    def configuration_error(self) -> str | None:
        own_error = super().configuration_error()
        if own_error is not None:
            return own_error
        plan = self.mesh_plan()
        degrees = plan.resolved_degrees
        pipelined = self.pipeline is not None
        cannot_split = context_parallel.refusal(degrees["context_parallel"], self.accelerator.device_type, pipelined)
        if cannot_split is not None:
            return f"{type(self).__name__}: {cannot_split}"
        if self.pipeline is None:
            return self._tensor_parallel_error(plan)
        try:
            _check_pipeline_dimension(plan, self.pipeline)
            self.pipeline.check_degree(degrees["pipeline_parallel"])
        except ValueError as error:
            return f"{type(self).__name__}: {error}"
        if self.precision.requires_fabric_backward:
            return (
                f"ModelParallelStrategy(pipeline=...) with precision={self.precision.name!r}: the pipeline runs the "
                "backward inside the model's call, where the loss is not scaled; use '32-true', 'bf16-mixed' or "
                "'bf16-true'."
            )
        return self._tensor_parallel_error(plan)

    def _tensor_parallel_error(self, plan: MeshPlan) -> str | None:
        degree = plan.resolved_degrees["tensor_parallel"]
        if degree > 1 and self.parallelize_fn is None:
            return (
                f"ModelParallelStrategy: the mesh {plan.describe()} has tensor_parallel={degree} but no "
                "parallelize_fn to split the layers; pass parallelize_fn=."
            )
        return None

    @override
    def planned_mesh(self) -> MeshPlan:
        """The mesh given, else Lightning's two sizes; with a pipeline plan and neither, one stage per
        ``pipeline_parallel`` rank (two under a V schedule) and FSDP over what is left."""
        if self.mesh_plan_given is not None:
            return self.mesh_plan_given
        sizes = (self.data_parallel_size, self.tensor_parallel_size)
        if self.pipeline is None:
            return lightning_mesh(self.num_nodes, *sizes)
        plan = MeshPlan() if sizes == (AUTO, AUTO) else lightning_mesh(self.num_nodes, *sizes)
        return replace(plan, pipeline_parallel=self.pipeline.default_degree)

    @property
    def tensor_parallel_mesh(self) -> DeviceMesh:
        return self.mesh["tensor_parallel"]

    @property
    @override
    def data_parallel_mesh(self) -> DeviceMesh:
        """With context parallelism FSDP shards over ``data_parallel x context_parallel`` flattened (the parts of a
        sequence average their gradients as data-parallel ranks do), with replicas as its second dimension."""
        if self.mesh_plan().context_parallel == 1:
            return super().data_parallel_mesh
        shard = self.mesh["data_parallel", "context_parallel"]._flatten(SHARD_AND_CONTEXT)
        if self.mesh_plan().data_parallel_replicate == 1:
            return shard
        return self.mesh["data_parallel_replicate", SHARD_AND_CONTEXT]

    @override
    def context_parallel(
        self,
        buffers: Sequence[torch.Tensor],
        seq_dims: Sequence[int],
        no_restore: Sequence[torch.Tensor] = (),
    ) -> AbstractContextManager[None]:
        """Inside: each buffer holds this rank's part of its sequence (see :mod:`fabric.strategies.context_parallel`);
        nothing happens without context parallelism."""
        plan = self.mesh_plan()
        degree = plan.resolved_degrees["context_parallel"]
        if degree == 1:
            return super().context_parallel(buffers, seq_dims, no_restore)
        if not self._context_batches_checked:  # the group's ranks must split the same sequences (a collective)
            self._context_batches_checked = True
            sharers = _described({"context_parallel": degree})
            refuse_different_batches(list(buffers), plan.data_parallel_index(self.global_rank), sharers)
        return context_parallel.sequence_sharded(self.mesh["context_parallel"], buffers, seq_dims, no_restore)

    @property
    def pipeline_stages(self) -> tuple[int, ...]:
        """This rank's stages (by its position along ``pipeline_parallel``); ``(0,)`` without pipeline parallelism."""
        if self.pipeline is None:
            return (0,)
        degree = self.mesh_plan().resolved_degrees["pipeline_parallel"]
        rank = 0 if degree == 1 else self.mesh["pipeline_parallel"].get_local_rank()
        return self.pipeline.stages_of(rank, degree)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Keep this rank's pipeline stage (with a pipeline plan), parallelize and shard it; with a plan the
        forward runs through a :class:`~fabric.strategies.pipeline.PipelineModule`."""
        forward_module = super().setup_module(module)
        if self.pipeline is not None:
            group = self.mesh["pipeline_parallel"].get_group()
            stage_modules = self._shard_roots(forward_module)
            forward_module = PipelineModule(
                forward_module, stage_modules, self.pipeline, self.pipeline_stages, group, self.root_device
            )
            self._pipelines.add(forward_module)
        plan = self.mesh_plan()
        # ranks that hold parts of one model copy: a self-sharding loader would feed them different data (the ranks of
        # a context-parallel group forward parts of one sequence: compared whole in context_parallel())
        sharers = {name: degree for name, degree in plan.resolved_degrees.items() if name not in SEQUENCE_SHARED}
        sharers = {name: degree for name, degree in sharers.items() if degree > 1}
        if sharers:
            index = (plan.data_parallel_index(self.global_rank), self._context_parallel_rank())
            check_first_batch(
                forward_module,
                functools.partial(refuse_different_batches, data_parallel_index=index, sharers=_described(sharers)),
            )
        return forward_module

    def _context_parallel_rank(self) -> int:
        return 0 if self.mesh_plan().context_parallel == 1 else self.mesh["context_parallel"].get_local_rank()

    @override
    def _shard(self, module: nn.Module) -> nn.Module:
        stages, parts = self.pipeline_stages, {}
        if self.pipeline is not None:
            plan = self.pipeline
            parts = stage_parts(module, plan.split_points, plan.network, plan.every_stage)
            keep_stages(module, parts, stages)
        parallelized = module if self.parallelize_fn is None else self.parallelize_fn(module, self.mesh)
        if not isinstance(parallelized, nn.Module):
            raise TypeError(
                f"parallelize_fn must return the parallelized nn.Module; it returned {type(parallelized).__name__}."
            )
        sharded_by_user = any(isinstance(submodule, FSDPModule) for submodule in parallelized.modules())
        if self.pipeline is not None and len(stages) > 1:
            if sharded_by_user:
                raise ValueError(
                    f"ModelParallelStrategy(pipeline=PipelinePlan(schedule={self.pipeline.schedule!r})) holds "
                    f"stages {list(stages)} on this rank, each an FSDP root of its own, but parallelize_fn already "
                    "called fully_shard: leave FSDP to the strategy (shard_modules=...) under several stages per rank."
                )
            self._stage_views[parallelized] = [stage_view(parallelized, parts, stage) for stage in stages]
        if sharded_by_user:
            if self.pipeline is not None and self.pipeline.splits_backward:  # see reshard_after_forward in __init__
                for submodule in parallelized.modules():
                    if isinstance(submodule, FSDPModule):
                        submodule.set_reshard_after_forward(False, recurse=False)
            return parallelized
        return super()._shard(parallelized)  # activation checkpointing, FSDP units, the roots

    @override
    def _shard_roots(self, module: nn.Module) -> list[nn.Module]:
        """One view per stage when this rank holds several (torch's pipeline stage runs and reduces each as an
        FSDP root), else the module."""
        return self._stage_views.get(module, [module])

    @override
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """With a pipeline the backward already ran in ``model(inputs, target=targets)``: its loss is accepted and
        nothing runs; any other tensor is refused (its backward would not reach the other stages)."""
        if self.pipeline is None:
            super().backward(tensor, module, *args, **kwargs)
            return
        if not any(pipeline.returned(tensor) for pipeline in self._pipelines):
            raise ValueError(
                "Under pipeline parallelism the backward runs inside model(inputs, target=targets), with the "
                "PipelinePlan's loss_fn; fabric.backward takes only the loss that call returned."
            )

    @override
    def _ranks_with_other_parameters(self) -> ProcessGroup | None:
        """The pipeline's ranks, which hold the other stages' parameters (their gradients count in a norm)."""
        return None if self.pipeline is None else self.mesh["pipeline_parallel"].get_group()

    @override
    def save_checkpoint(
        self,
        path: PathType,
        state: dict[str, Any],
        filter: Mapping[str, CheckpointFilter] | None = None,
        storage_options: StorageOptions = None,
        async_save: bool = False,
    ) -> Future[None]:
        """Under pipeline parallelism each optimizer's parameter groups list the parameters of every stage, so the
        directory is the one any other mesh saves (a group listing one stage's would be read by all)."""
        if self.pipeline is not None:
            state = {key: self._whole_pipeline_state(value) for key, value in state.items()}
        return super().save_checkpoint(path, state, filter, storage_options, async_save)

    def _whole_pipeline_state(self, value: Any) -> Any:
        if not isinstance(value, Optimizer):
            return value
        optimizer_state: dict[str, Any] = dict(get_optimizer_state_dict(self.owner_of(value), value))
        group = self.mesh["pipeline_parallel"].get_group()
        for param_group in optimizer_state["param_groups"]:
            stages: list[list[str]] = [[] for _ in range(self.mesh["pipeline_parallel"].size())]
            torch.distributed.all_gather_object(stages, param_group["params"], group=group)
            param_group["params"] = [name for stage in stages for name in stage]
        return optimizer_state

    def __repr__(self) -> str:
        return (
            f"ModelParallelStrategy(devices={len(self._parallel_devices or [])}, "
            f"mesh={self.planned_mesh().describe()}, state_dict_type={self.state_dict_type!r})"
        )


#: What pipeline stages cannot do here, and what to do instead.
PIPELINE_REFUSALS = {
    "huggingface": "each rank holds only its pipeline stages; save a sharded checkpoint (fabric.save) and convert the "
    "consolidated file instead.",
}

#: The name of the flattened ``data_parallel x context_parallel`` dimension FSDP shards over.
SHARD_AND_CONTEXT = "data_parallel_context_parallel"
#: The dimensions whose ranks' forwards are not given the same batch: different data, or parts of one sequence.
SEQUENCE_SHARED = (*DATA_PARALLEL_DIMS, "context_parallel")


def _described(sharers: Mapping[str, int]) -> str:
    return " x ".join(f"{name}={degree}" for name, degree in sharers.items())


def _check_pipeline_dimension(mesh: MeshPlan, pipeline: PipelinePlan | None) -> None:
    if mesh.pipeline_parallel != 1 and pipeline is None:
        raise ValueError(
            f"MeshPlan(pipeline_parallel={mesh.pipeline_parallel!r}) needs to know where to cut the model: pass "
            "ModelParallelStrategy(pipeline=PipelinePlan(split_points=[...], loss_fn=...))."
        )
