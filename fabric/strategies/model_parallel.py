"""Model parallelism on the N-D device mesh: tensor parallelism by the user's ``parallelize_fn``, FSDP2 (or HSDP)
over the data-parallel dimensions.

The mesh is the one :class:`~fabric.strategies.mesh.MeshPlan` describes; Lightning's
``ModelParallelStrategy(data_parallel_size, tensor_parallel_size)`` is ``MeshPlan(data_parallel=...,
tensor_parallel=...)``. The user's ``parallelize_fn(model, device_mesh)`` splits layers over
``device_mesh["tensor_parallel"]`` (DTensor's ``parallelize_module`` with Colwise/Rowwise plans); the strategy then
shards the result with ``fully_shard`` over the data-parallel dimensions (``data_parallel``, with
``data_parallel_replicate`` when there are replicas), unless ``parallelize_fn`` applied ``fully_shard`` itself.
Data is split over the data-parallel dimensions only: the ranks of one tensor-parallel group read the same batches.

Everything after the sharding is :class:`~fabric.strategies.fsdp.FSDPStrategy`'s: optimizers built
before setup are re-pointed, meta-device models are materialised, and checkpoints are DCP directories
(:mod:`fabric.strategies.fsdp.checkpoint`) that load on any other mesh shape and in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from typing_extensions import Unpack, override

from fabric.strategies.fsdp.options import ShardPolicy
from fabric.strategies.fsdp.strategy import FSDPStrategy, StateDictType
from fabric.strategies.mesh import AUTO, MeshPlan
from fabric.strategies.parallel import ParallelArgs, refuse_unexpected_arguments

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
        reshard_after_forward, state_dict_type, shard_modules, activation_checkpointing, mixed_precision,
            sync_module_states: as in :class:`~fabric.strategies.fsdp.FSDPStrategy`, applied after
            ``parallelize_fn`` (unless it sharded itself).
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
        reshard_after_forward: bool = True,
        state_dict_type: StateDictType = "sharded",
        shard_modules: ShardPolicy | None = None,
        activation_checkpointing: set[type[nn.Module]] | None = None,
        mixed_precision: MixedPrecisionPolicy | None = None,
        sync_module_states: bool = False,
        **common: Unpack[ParallelArgs],
    ) -> None:
        if not callable(parallelize_fn):
            raise ValueError(
                f"ModelParallelStrategy needs parallelize_fn, a callable (model, device_mesh) -> model; got "
                f"{parallelize_fn!r}. Pass strategy=ModelParallelStrategy(parallelize_fn=...) instead of "
                "strategy='model_parallel'."
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
            _refuse_unavailable_dimensions(mesh)
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

    @override
    def _check_mesh(self, plan: MeshPlan) -> None:
        if (self.data_parallel_size, self.tensor_parallel_size) != (AUTO, AUTO):
            raise ValueError(
                f"ModelParallelStrategy(data_parallel_size={self.data_parallel_size!r}, tensor_parallel_size="
                f"{self.tensor_parallel_size!r}) conflicts with the CLI's --mesh={plan.as_text()}. Remove one of them."
            )
        _refuse_unavailable_dimensions(plan)

    @override
    def planned_mesh(self) -> MeshPlan:
        if self.mesh_plan_given is not None:
            return self.mesh_plan_given
        return lightning_mesh(self.num_nodes, self.data_parallel_size, self.tensor_parallel_size)

    @property
    def tensor_parallel_mesh(self) -> DeviceMesh:
        return self.mesh["tensor_parallel"]

    @override
    def _shard(self, module: nn.Module) -> nn.Module:
        assert self.parallelize_fn is not None  # checked at construction
        parallelized = self.parallelize_fn(module, self.mesh)
        if not isinstance(parallelized, nn.Module):
            raise TypeError(
                f"parallelize_fn must return the parallelized nn.Module; it returned {type(parallelized).__name__}."
            )
        if any(isinstance(submodule, FSDPModule) for submodule in parallelized.modules()):
            return parallelized
        return super()._shard(parallelized)  # activation checkpointing, FSDP units, the root

    def __repr__(self) -> str:
        return (
            f"ModelParallelStrategy(devices={len(self._parallel_devices or [])}, "
            f"mesh={self.planned_mesh().describe()}, state_dict_type={self.state_dict_type!r})"
        )


#: Mesh dimensions a degree above 1 of which this strategy cannot honour yet, and why.
UNAVAILABLE_DIMENSIONS = {
    "pipeline_parallel": "pipeline parallelism is not available yet (issue 43)",
    "context_parallel": "torch's context_parallel shards the CUDA attention kernels only (on CPU its backward has no "
    "sharding strategy for aten._scaled_dot_product_flash_attention_for_cpu_backward), and it is not wired here yet",
}


def _refuse_unavailable_dimensions(mesh: MeshPlan) -> None:
    for name, reason in UNAVAILABLE_DIMENSIONS.items():
        if mesh.degrees[name] != 1:
            raise ValueError(f"MeshPlan({name}={mesh.degrees[name]!r}) cannot be honoured: {reason}.")
