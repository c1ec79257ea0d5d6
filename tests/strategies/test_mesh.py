"""MeshPlan: degrees resolve against the world; a mesh that cannot be built fails at construction in one line."""

from __future__ import annotations

import pytest

from fabric import Fabric
from fabric.strategies import FSDPStrategy, MeshPlan, ModelParallelStrategy


def _identity(model, mesh):  # type: ignore[no-untyped-def]
    return model


@pytest.mark.parametrize(
    ("plan", "world", "expected"),
    [
        (MeshPlan(), 4, {"data_parallel": 4}),
        (MeshPlan(data_parallel_replicate=2), 4, {"data_parallel_replicate": 2, "data_parallel": 2}),
        (MeshPlan(data_parallel_replicate=-1, data_parallel=1), 4, {"data_parallel_replicate": 4, "data_parallel": 1}),
        (MeshPlan(data_parallel=2, tensor_parallel="auto"), 8, {"data_parallel": 2, "tensor_parallel": 4}),
        (
            MeshPlan(pipeline_parallel=2, data_parallel_replicate=2, tensor_parallel=2),
            16,
            {"pipeline_parallel": 2, "data_parallel_replicate": 2, "data_parallel": 2, "tensor_parallel": 2},
        ),
    ],
)
def test_the_auto_degree_is_what_the_others_leave(plan: MeshPlan, world: int, expected: dict[str, int]) -> None:
    resolved = plan.resolve(world)
    ones = {name: 1 for name in resolved.degrees}
    assert resolved.resolved_degrees == ones | expected
    assert resolved.size == world


def test_the_mesh_has_the_dimensions_above_one_and_always_the_two_lightning_indexes() -> None:
    assert MeshPlan().resolve(4).built_dimensions == {"data_parallel": 4, "tensor_parallel": 1}
    plan = MeshPlan(data_parallel_replicate=2, tensor_parallel=2).resolve(8)
    assert plan.built_dimensions == {"data_parallel_replicate": 2, "data_parallel": 2, "tensor_parallel": 2}


def test_the_data_share_of_a_rank_follows_replicate_by_shard_and_tensor_neighbours_share_it() -> None:
    plan = MeshPlan(pipeline_parallel=2, data_parallel_replicate=2, data_parallel=2, tensor_parallel=2).resolve(16)
    assert plan.data_parallel_size == 4
    # ranks 0-7 are the first pipeline stage, 8-15 the second; tensor-parallel pairs are neighbours
    assert [plan.data_parallel_index(rank) for rank in range(16)] == [0, 0, 1, 1, 2, 2, 3, 3] * 2


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"data_parallel": 0}, r"MeshPlan\(data_parallel=0\) is not valid. Accepted: a positive int, 'auto' or -1"),
        ({"tensor_parallel": 2.0}, r"MeshPlan\(tensor_parallel=2.0\) is not valid"),
        ({"tensor_parallel": True}, r"MeshPlan\(tensor_parallel=True\) is not valid"),
        ({"tensor_parallel": "auto"}, r"only one degree may be 'auto'; data_parallel and tensor_parallel both are"),
    ],
)
def test_a_bad_degree_is_refused_naming_it(arguments: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MeshPlan(**arguments)  # type: ignore[arg-type]


def test_degrees_that_do_not_make_the_world_fail_when_fabric_is_built() -> None:
    with pytest.raises(
        ValueError,
        match=r"FSDPStrategy: The mesh data_parallel_replicate=3 x data_parallel=auto does not fit 4 processes",
    ):
        Fabric(accelerator="cpu", devices=4, strategy=FSDPStrategy(mesh=MeshPlan(data_parallel_replicate=3)))
    strategy = ModelParallelStrategy(_identity, mesh=MeshPlan(data_parallel=2, tensor_parallel=2))
    with pytest.raises(ValueError, match=r"data_parallel=2 x tensor_parallel=2 does not fit 8 processes"):
        Fabric(accelerator="cpu", devices=8, strategy=strategy)


def test_fsdp_alone_refuses_a_tensor_parallel_degree_naming_the_strategy_that_takes_it() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel=2 needs ModelParallelStrategy\(parallelize_fn, mesh=...\)"):
        FSDPStrategy(mesh=MeshPlan(tensor_parallel=2))
    with pytest.raises(ValueError, match=r"replicate_only=True \(NO_SHARD\) and mesh=.*data_parallel=2"):
        FSDPStrategy(replicate_only=True, mesh=MeshPlan(data_parallel_replicate=2, data_parallel=2))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            {"pipeline_parallel": 2},
            r"MeshPlan\(pipeline_parallel=2\) needs to know where to cut the model: pass "
            r"ModelParallelStrategy\(pipeline=PipelinePlan\(split_points=\[...\], loss_fn=...\)\)",
        ),
    ],
)
def test_a_pipeline_degree_without_a_plan_is_refused_with_the_reason(arguments: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelParallelStrategy(_identity, mesh=MeshPlan(**arguments))  # type: ignore[arg-type]


def test_a_mesh_and_lightnings_sizes_together_are_refused() -> None:
    with pytest.raises(ValueError, match="got mesh= and data_parallel_size/tensor_parallel_size"):
        ModelParallelStrategy(_identity, 2, 2, mesh=MeshPlan())
