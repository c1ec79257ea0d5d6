"""Model parallelism on a 2-D device mesh: tensor parallelism within a group of ranks, FSDP2 across groups.

The mesh has the dimensions ``("data_parallel", "tensor_parallel")``. The user's
``parallelize_fn(model, device_mesh)`` splits layers over ``device_mesh["tensor_parallel"]`` (DTensor's
``parallelize_module`` with Colwise/Rowwise plans); the strategy then shards the result with
``fully_shard`` over ``device_mesh["data_parallel"]``, unless ``parallelize_fn`` applied ``fully_shard``
itself. Data is split over the data-parallel dimension only: the ranks of one tensor-parallel group read
the same batches.

Everything after the sharding is :class:`~fabric.strategies.fsdp.FSDPStrategy`'s: optimizers built
before setup are re-pointed, meta-device models are materialised, and checkpoints are DCP directories
(:mod:`fabric.strategies.fsdp.checkpoint`) that load on any other mesh shape and in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from typing_extensions import Unpack, override

from fabric.strategies.fsdp.strategy import FSDPStrategy, StateDictType
from fabric.strategies.parallel import ParallelArgs, ParallelStrategy, refuse_unexpected_arguments

#: ``parallelize_fn(model, device_mesh) -> model``: applies tensor parallelism (and optionally FSDP) in place.
ParallelizeFn = Callable[[nn.Module, DeviceMesh], nn.Module]
MeshSize = int | Literal["auto"]
MESH_DIM_NAMES = ("data_parallel", "tensor_parallel")


def _check_size(name: str, value: Any) -> None:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return
    raise ValueError(f"{name}={value!r} is not valid. Accepted: a positive int or 'auto'.")


def mesh_shape(
    world_size: int, num_nodes: int, data_parallel_size: MeshSize, tensor_parallel_size: MeshSize
) -> tuple[int, int]:
    """``(data_parallel, tensor_parallel)`` sizes whose product is ``world_size``.

    With both ``"auto"``: tensor parallelism within a node, data parallelism across nodes. With one
    ``"auto"``: what the other leaves.
    """
    if data_parallel_size == "auto" and tensor_parallel_size == "auto":
        data_parallel_size = num_nodes
    if tensor_parallel_size == "auto":
        assert data_parallel_size != "auto"
        tensor_parallel_size = _rest(world_size, data_parallel_size)
    elif data_parallel_size == "auto":
        data_parallel_size = _rest(world_size, tensor_parallel_size)
    if data_parallel_size * tensor_parallel_size != world_size:
        raise ValueError(
            f"ModelParallelStrategy: data_parallel_size x tensor_parallel_size must equal the number of processes "
            f"({world_size}); the sizes given ({data_parallel_size!r}, {tensor_parallel_size!r}) do not divide it."
        )
    return data_parallel_size, tensor_parallel_size


def _rest(world_size: int, size: int) -> int:
    """The other dimension's size, or 0 when ``size`` does not divide ``world_size``."""
    return world_size // size if world_size % size == 0 else 0


class ModelParallelStrategy(FSDPStrategy):
    """Tensor parallelism by ``parallelize_fn`` on a 2-D mesh, FSDP2 on its data-parallel dimension.

    Args:
        parallelize_fn: ``(model, device_mesh) -> model``; called once in ``fabric.setup`` with the
            2-D mesh. Typically calls ``parallelize_module(model, device_mesh["tensor_parallel"], plan)``.
            If it applies ``fully_shard`` itself, the strategy does not shard again.
        data_parallel_size: ranks that hold different data (FSDP shards over them); ``"auto"``: the
            number of nodes, or what ``tensor_parallel_size`` leaves.
        tensor_parallel_size: ranks that split each layer; ``"auto"``: the processes per node, or what
            ``data_parallel_size`` leaves.
        reshard_after_forward, state_dict_type: as in :class:`~fabric.strategies.fsdp.FSDPStrategy`.
        **common: the arguments of every parallel strategy (:class:`~fabric.strategies.parallel.ParallelArgs`);
            FSDPStrategy's other options (Lightning's too) are not taken.
    """

    def __init__(
        self,
        parallelize_fn: ParallelizeFn | None = None,
        data_parallel_size: MeshSize = "auto",
        tensor_parallel_size: MeshSize = "auto",
        *,
        reshard_after_forward: bool = True,
        state_dict_type: StateDictType = "sharded",
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
        refuse_unexpected_arguments(type(self), common)  # FSDPStrategy would take the others as Lightning's
        super().__init__(reshard_after_forward=reshard_after_forward, state_dict_type=state_dict_type, **common)
        self.parallelize_fn = parallelize_fn
        self.data_parallel_size = data_parallel_size
        self.tensor_parallel_size = tensor_parallel_size

    @override
    def configuration_error(self) -> str | None:
        own_error = ParallelStrategy.configuration_error(self)  # FSDP's own checks do not apply
        if own_error is not None:
            return own_error
        try:
            self.mesh_shape()
        except ValueError as error:
            return str(error)
        return None

    def mesh_shape(self) -> tuple[int, int]:
        """The resolved ``(data_parallel, tensor_parallel)`` sizes."""
        return mesh_shape(self.world_size, self.num_nodes, self.data_parallel_size, self.tensor_parallel_size)

    @override
    def setup_environment(self) -> None:
        ParallelStrategy.setup_environment(self)
        self._mesh = init_device_mesh(self.root_device.type, self.mesh_shape(), mesh_dim_names=MESH_DIM_NAMES)

    @property
    def data_parallel_mesh(self) -> DeviceMesh:
        return self.mesh[MESH_DIM_NAMES[0]]

    @property
    def tensor_parallel_mesh(self) -> DeviceMesh:
        return self.mesh[MESH_DIM_NAMES[1]]

    @property
    @override
    def data_parallel_shard(self) -> tuple[int, int]:
        """Split over the data-parallel dimension: a tensor-parallel group shares its batches."""
        mesh = self.data_parallel_mesh
        return mesh.size(), mesh.get_local_rank()

    @override
    def _shard(self, module: nn.Module) -> nn.Module:
        assert self.parallelize_fn is not None  # checked at construction
        parallelized = self.parallelize_fn(module, self.mesh)
        if not isinstance(parallelized, nn.Module):
            raise TypeError(
                f"parallelize_fn must return the parallelized nn.Module; it returned {type(parallelized).__name__}."
            )
        if not any(isinstance(submodule, FSDPModule) for submodule in parallelized.modules()):
            fully_shard(parallelized, **self._shard_options(self.data_parallel_mesh))
        return parallelized

    def __repr__(self) -> str:
        return (
            f"ModelParallelStrategy(devices={len(self._parallel_devices or [])}, "
            f"data_parallel_size={self.data_parallel_size!r}, tensor_parallel_size={self.tensor_parallel_size!r}, "
            f"state_dict_type={self.state_dict_type!r})"
        )
