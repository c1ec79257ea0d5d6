"""FSDPStrategy configured with Lightning Fabric's (FSDP1) arguments: each is translated to FSDP2 settings or
refused naming what to use instead; three real 2-rank gloo runs check the translated settings train like one
process on the full batch (tests/scripts/fsdp_lightning_job.py)."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_fsdp import SCRIPTS, _run
from torch import nn
from torch.distributed.fsdp import CPUOffload, MixedPrecision, MixedPrecisionPolicy, ShardingStrategy
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    _recursive_wrap,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from fabric import Fabric
from fabric.strategies.fsdp.options import UnitsLikeFsdp1, shard_units
from fabric.strategies.fsdp.strategy import FSDPStrategy
from fabric.strategies.mesh import MeshPlan


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)


def _model() -> nn.Module:
    """Nested layers of several sizes, a ModuleList (never a unit by the size policy) and parameters of its own."""
    blocks = nn.ModuleList([Block(), Block(32)])
    model = nn.Sequential(nn.Linear(6, 16), blocks, nn.Sequential(Block(8), nn.Linear(8, 1)))
    model.register_parameter("scale", nn.Parameter(torch.ones(40)))
    return model


# --- auto_wrap_policy -> shard_modules -------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy",
    [
        {Block},
        [Block],
        ModuleWrapPolicy({Block}),
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
    ],
    ids=["set", "list", "ModuleWrapPolicy", "transformer_auto_wrap_policy"],
)
def test_auto_wrap_policy_naming_classes_becomes_shard_modules(policy: Any) -> None:
    assert FSDPStrategy(auto_wrap_policy=policy).shard_modules == {Block}


def _fsdp1_units(model: nn.Module, policy: Any) -> list[str]:
    """The modules FSDP1's own recursive wrap (torch's code) makes units of, the root left out."""
    wrapped: list[nn.Module] = []

    def record(module: nn.Module, **kwargs: Any) -> nn.Module:
        wrapped.append(module)
        return module

    _recursive_wrap(model, policy, record, ignored_modules=set(), ignored_params=set(), only_wrap_children=True)
    return sorted(name for name, module in model.named_modules() if any(module is w for w in wrapped))


@pytest.mark.parametrize("min_num_params", [1, 100, 300, 600, 1200, 2000, 10**8])
def test_an_fsdp1_size_policy_chooses_the_units_fsdp1_would(min_num_params: int) -> None:
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params)
    strategy = FSDPStrategy(auto_wrap_policy=policy)
    assert isinstance(strategy.shard_modules, UnitsLikeFsdp1)
    model = _model()
    units = shard_units(strategy.shard_modules, model)
    ours = sorted(name for name, module in model.named_modules() if module in units)
    assert ours == _fsdp1_units(model, policy)
    if min_num_params == 300:  # Block(16) (304) is a unit; Block(32) is not: its Linear (1056 of 1120) already is
        assert ours == ["1.0", "1.1.linear"]


def test_an_fsdp1_lambda_policy_is_asked_about_each_module() -> None:
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda module: isinstance(module, nn.LayerNorm))
    strategy = FSDPStrategy(auto_wrap_policy=policy)
    model = _model()
    units = shard_units(strategy.shard_modules, model)
    ours = sorted(name for name, module in model.named_modules() if module in units)
    assert ours == _fsdp1_units(model, policy) == ["1.0.norm", "1.1.norm", "2.0.norm"]


def test_an_fsdp1_policy_that_does_not_enter_a_module_keeps_its_children_out_of_units() -> None:
    """FSDP1's size policy never recurses into nn.MultiheadAttention: its out_proj is no unit of its own
    (a unit inside the attention's own forward fails at the first step, mixing Tensor and DTensor)."""
    model = nn.Sequential(nn.MultiheadAttention(16, 2), nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)))
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=100)
    units = shard_units(FSDPStrategy(auto_wrap_policy=policy).shard_modules, model)
    ours = sorted(name for name, module in model.named_modules() if module in units)
    assert ours == _fsdp1_units(model, policy) == ["1.0", "1.1"]


@pytest.mark.parametrize(
    "policy",
    [lambda module: True, CustomPolicy(lambda module: True), "Block", {Block, "Linear"}],
    ids=["one-argument predicate", "CustomPolicy", "string", "mixed set"],
)
def test_other_auto_wrap_policies_are_refused_naming_shard_modules(policy: Any) -> None:
    with pytest.raises(ValueError, match=r"auto_wrap_policy=.* is not valid.*pass shard_modules="):
        FSDPStrategy(auto_wrap_policy=policy)


# --- sharding_strategy -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "reshard", "hybrid", "replicate"),
    [
        ("FULL_SHARD", True, False, False),
        ("full_shard", True, False, False),
        ("SHARD_GRAD_OP", False, False, False),
        (ShardingStrategy.SHARD_GRAD_OP, False, False, False),
        ("Hybrid_Shard", True, True, False),
        (ShardingStrategy._HYBRID_SHARD_ZERO2, False, True, False),
        ("NO_SHARD", True, False, True),
        (ShardingStrategy.NO_SHARD, True, False, True),
    ],
)
def test_sharding_strategy_sets_resharding_and_the_mesh(
    value: Any, reshard: bool, hybrid: bool, replicate: bool
) -> None:
    strategy = FSDPStrategy(sharding_strategy=value)
    settings = (strategy.reshard_after_forward, strategy.hybrid_shard, strategy.replicate_only)
    assert settings == (reshard, hybrid, replicate)


@pytest.mark.parametrize("value", ["ZERO3", 1, None])
def test_an_unknown_sharding_strategy_is_refused_listing_the_accepted_ones(value: Any) -> None:
    accepted = "FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, _HYBRID_SHARD_ZERO2, NO_SHARD"
    with pytest.raises(ValueError, match=rf"sharding_strategy={value!r} is not valid. Accepted: {accepted}"):
        FSDPStrategy(sharding_strategy=value)


def test_replicate_only_is_a_world_by_one_mesh() -> None:
    strategy = Fabric(accelerator="cpu", devices=4, strategy=FSDPStrategy(sharding_strategy="NO_SHARD")).strategy
    plan = strategy.mesh_plan()  # type: ignore[attr-defined]
    assert (plan.data_parallel_replicate, plan.data_parallel) == (4, 1)


def test_lightnings_device_mesh_sizes_are_the_replicate_by_shard_plan() -> None:
    strategy = FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2))
    assert strategy.planned_mesh() == MeshPlan(data_parallel_replicate=2, data_parallel=2)
    with pytest.raises(ValueError, match=r"device_mesh=.*DeviceMesh.* is not valid. Accepted: a \(replicate, shard\)"):
        FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh="DeviceMesh('cpu', [[0, 1]])")
    with pytest.raises(ValueError, match=r"mesh data_parallel_replicate=2 x data_parallel=2 does not fit 6 processes"):
        Fabric(accelerator="cpu", devices=6, strategy=FSDPStrategy(device_mesh=(2, 2)))


def test_the_defaults_are_unchanged() -> None:
    strategy = FSDPStrategy()
    assert (strategy.reshard_after_forward, strategy.hybrid_shard, strategy.replicate_only) == (True, False, False)
    assert (strategy.shard_modules, strategy.activation_checkpointing, strategy.cpu_offload) == (None, set(), False)
    assert (strategy.mixed_precision, strategy.sync_module_states) == (None, False)


# --- activation_checkpointing_policy, cpu_offload, mixed_precision -----------------------------------------------


@pytest.mark.parametrize("policy", [{Block}, ModuleWrapPolicy({Block})], ids=["set", "ModuleWrapPolicy"])
def test_activation_checkpointing_policy_becomes_activation_checkpointing(policy: Any) -> None:
    assert FSDPStrategy(activation_checkpointing_policy=policy).activation_checkpointing == {Block}


def test_a_callable_activation_checkpointing_policy_is_refused_naming_the_own_argument() -> None:
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=10)
    with pytest.raises(ValueError, match=r"recomputes whole layer classes.*activation_checkpointing=\{\.\.\.\}"):
        FSDPStrategy(activation_checkpointing_policy=policy)


@pytest.mark.parametrize(
    ("value", "expected"), [(CPUOffload(offload_params=True), True), (CPUOffload(), False), (True, True)]
)
def test_cpu_offload_takes_fsdp1s_cpu_offload(value: Any, expected: bool) -> None:
    assert FSDPStrategy(cpu_offload=value).cpu_offload is expected


def test_an_fsdp1_cpu_offload_on_cpu_is_refused_like_the_own_flag() -> None:
    with pytest.raises(ValueError, match=r"needs an accelerator.*Use strategy='fsdp'"):
        Fabric(accelerator="cpu", strategy=FSDPStrategy(cpu_offload=CPUOffload(offload_params=True)), devices=2)


def test_a_bad_cpu_offload_is_refused_naming_the_value() -> None:
    with pytest.raises(ValueError, match=r"cpu_offload='yes' is not valid. Accepted: True, False or .*CPUOffload"):
        FSDPStrategy(cpu_offload="yes")  # type: ignore[arg-type]


def test_fsdp1_mixed_precision_becomes_the_fsdp2_policy_and_overrides_the_plugins() -> None:
    given = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fabric = Fabric(accelerator="cpu", strategy=FSDPStrategy(mixed_precision=given), devices=2, precision="16-mixed")
    policy = fabric.strategy.mixed_precision_policy()  # type: ignore[attr-defined]
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert policy.cast_forward_inputs  # FSDP1 casts the root's inputs by default
    uncast = MixedPrecision(param_dtype=torch.float16, cast_root_forward_inputs=False)
    policy = FSDPStrategy(mixed_precision=uncast).mixed_precision_policy()
    assert (policy.param_dtype, policy.reduce_dtype, policy.cast_forward_inputs) == (torch.float16, None, False)


def test_an_fsdp2_mixed_precision_policy_is_used_as_it_is() -> None:
    given = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    assert FSDPStrategy(mixed_precision=given).mixed_precision_policy() is given


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16),
            r"buffer_dtype=torch.bfloat16\) cannot be honoured: FSDP2 does not cast buffers.*Leave buffer_dtype=None",
        ),
        (
            MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True),
            r"keep_low_precision_grads=True\) cannot be honoured.*precision='bf16-true'",
        ),
        ("bf16", r"mixed_precision='bf16' is not valid. Accepted: .*MixedPrecisionPolicy"),
    ],
)
def test_mixed_precision_fsdp2_cannot_honour_is_refused(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FSDPStrategy(mixed_precision=value)


# --- always so in FSDP2, refused and unknown arguments, conflicts ----------------------------------------------


@pytest.mark.parametrize("name", ["use_orig_params", "limit_all_gathers"])
def test_what_fsdp2_always_does_is_accepted_as_true_and_refused_as_false(name: str) -> None:
    assert FSDPStrategy(**{name: True}).reshard_after_forward is True
    with pytest.raises(ValueError, match=rf"FSDPStrategy\({name}=False\) is not possible: FSDP2 .* Remove {name}"):
        FSDPStrategy(**{name: False})


@pytest.mark.parametrize(
    ("name", "alternative"),
    [
        ("process_group", r"mesh=MeshPlan\(data_parallel_replicate=..., data_parallel=...\)"),
        ("forward_prefetch", r"set_modules_to_forward_prefetch"),
        ("backward_prefetch", r"set_modules_to_backward_prefetch"),
        ("ignored_modules", r"fully_shard\(ignored_params=...\)"),
        ("ignored_states", r"fully_shard\(ignored_params=...\)"),
        ("param_init_fn", r"fabric.init_module\(empty_init=True\)"),
        ("device_id", r"Fabric\(accelerator=..., devices=...\)"),
    ],
)
def test_arguments_without_a_setting_are_refused_naming_the_fsdp2_equivalent(name: str, alternative: str) -> None:
    with pytest.raises(ValueError, match=rf"FSDPStrategy\({name}=...\) is not supported: .*{alternative}"):
        FSDPStrategy(**{name: object()})


def test_an_unknown_argument_is_a_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"FSDPStrategy has no argument shard_module=\{.*\}. .*auto_wrap_policy"):
        FSDPStrategy(shard_module={Block})


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"auto_wrap_policy": {Block}, "shard_modules": {Block}}, ("auto_wrap_policy", "shard_modules")),
        ({"sharding_strategy": "SHARD_GRAD_OP", "reshard_after_forward": True}, ("sharding_strategy", "reshard_after")),
        ({"sharding_strategy": "HYBRID_SHARD", "hybrid_shard": True}, ("sharding_strategy", "hybrid_shard")),
        ({"sharding_strategy": "NO_SHARD", "replicate_only": True}, ("sharding_strategy", "replicate_only")),
        (
            {"activation_checkpointing_policy": {Block}, "activation_checkpointing": {Block}},
            ("activation_checkpointing_policy", "activation_checkpointing"),
        ),
    ],
)
def test_a_lightning_name_with_the_own_name_for_the_same_thing_is_refused(kwargs: dict, names: tuple) -> None:
    with pytest.raises(ValueError, match=rf"got both {names[0]}= \(Lightning's name\) and {names[1]}.*pass only one"):
        FSDPStrategy(**kwargs)


def test_hybrid_shard_and_replicate_only_together_are_refused() -> None:
    with pytest.raises(ValueError, match=r"hybrid_shard=True .* and replicate_only=True .* pass one of them"):
        FSDPStrategy(hybrid_shard=True, replicate_only=True)


def test_sync_module_states_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match=r"sync_module_states='yes' is not valid. Accepted: True or False"):
        FSDPStrategy(sync_module_states="yes")  # type: ignore[arg-type]


# --- real 2-rank runs ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The three 2-rank jobs' output directory (one report per config and rank)."""
    out_dir = tmp_path_factory.mktemp("fsdp_lightning")
    for config in ("shard_grad_op", "hybrid", "no_shard"):
        result = _run([sys.executable, str(SCRIPTS / "fsdp_lightning_job.py"), str(out_dir), config])
        assert result.returncode == 0, result.stderr[-4000:]
    return out_dir


def _reports(out_dir: Path, config: str) -> list[dict]:
    return [json.loads((out_dir / f"{config}-rank{rank}.json").read_text()) for rank in range(2)]


def test_lightning_style_shard_grad_op_with_synced_states_trains_like_one_process(runs: Path) -> None:
    reports = _reports(runs, "shard_grad_op")
    assert [r["init_equals_reference"] for r in reports] == [True, False]  # rank 1 built another model ...
    assert all(r["set_up_equals_reference"] for r in reports)  # ... and got rank 0's by sync_module_states
    for report in reports:
        assert report["units"] == ["", "blocks.0", "blocks.1"]  # auto_wrap_policy={Block}
        assert report["mesh"] == [[2], ["data_parallel"]]
        assert report["gathered_between_forward_and_backward"] == [True] * 4  # SHARD_GRAD_OP: no reshard
        assert report["block_calls_per_step"] == [4] * 4  # 2 blocks, each recomputed in the backward
        assert report["max_diff_to_reference"] < 1e-5 and report["moved"] > 0.1
        assert report["local_numel"] < report["total_numel"]
    assert reports[0]["trained"] == reports[1]["trained"]


def test_hybrid_shard_on_one_node_with_an_fsdp1_size_policy_trains_like_one_process(runs: Path) -> None:
    reports = _reports(runs, "hybrid")
    for report in reports:
        assert report["mesh"] == [[2], ["data_parallel"]]  # one replica on one node: plain FSDP
        assert report["placements"] == ["S(0)"]
        assert report["units"] == ["", "blocks.0.linear", "blocks.1.linear"]  # min_num_params=200
        assert report["gathered_between_forward_and_backward"] == [False] * 4  # FULL_SHARD-like resharding
        assert report["block_calls_per_step"] == [2] * 4  # no activation checkpointing
        assert report["max_diff_to_reference"] < 1e-5 and report["moved"] > 0.1
        assert report["reload_equal"]
    assert sum(r["local_numel"] for r in reports) == reports[0]["total_numel"]
    assert reports[0]["trained"] == reports[1]["trained"]


def test_no_shard_replicates_and_fsdp1_mixed_precision_computes_in_bfloat16(runs: Path) -> None:
    reports = _reports(runs, "no_shard")
    for report in reports:
        assert report["mesh"] == [[2, 1], ["data_parallel_replicate", "data_parallel"]]
        assert report["local_numel"] == report["total_numel"]  # every rank holds whole parameters
        assert report["dtypes_in_forward"] == ["torch.bfloat16"] and report["sharded_dtype"] == "torch.float32"
        # bfloat16 compute: close to the float32 reference, but not equal to it
        assert 1e-5 < report["max_diff_to_reference"] < 2e-2 and report["moved"] > 0.1
        assert report["reload_equal"]
    assert reports[0]["trained"] == reports[1]["trained"]
