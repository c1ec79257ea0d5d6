"""Pipeline parallelism: the plan's checks, the cut of a model into stages, and Fabric's loop on 2 real ranks.

The loop runs in tests/scripts/pipeline_job.py (an MLP cut in 2 stages, or 4 on the 2 ranks; every schedule) against a
plain one-process reference of the same batches; the mesh shapes that compose pipelines with FSDP and TP, and
checkpoints across them, are in tests/strategies/test_mesh_shapes.py.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fabric import Fabric
from fabric.strategies import MeshPlan, ModelParallelStrategy, PipelinePlan
from fabric.strategies.pipeline import V_SCHEDULES, StageForward, keep_stages, stage_parts, stage_view

SCRIPT = Path(__file__).parents[1] / "scripts" / "pipeline_job.py"
HUGGINGFACE_SCRIPT = SCRIPT.with_name("pipeline_huggingface_job.py")


class GPT(nn.Module):
    """Embedding, blocks, head: a forward that skips the parts another stage holds (torchtitan's convention)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
        self.head = nn.Linear(4, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens) if self.embedding is not None else tokens
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def _parameter_names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


# --- the plan ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"split_points": "blocks.2"}, r"split_points='blocks.2'\) is not valid. Accepted: a sequence of submodule"),
        ({"split_points": []}, r"split_points=\[\]\) is not valid"),
        ({"split_points": ["a", "a"]}, r"names a submodule twice"),
        ({"loss_fn": "mse"}, r"PipelinePlan\(loss_fn='mse'\) is not valid. Accepted: \(output, target\) -> loss"),
        ({"microbatches": 0}, r"PipelinePlan\(microbatches=0\) is not valid. Accepted: a positive int or None"),
        (
            {"schedule": "zb"},
            r"PipelinePlan\(schedule='zb'\) is not valid. Accepted: \['GPipe', '1F1B', 'Interleaved1F1B', "
            r"'LoopedBFS', 'InterleavedZeroBubble', 'ZBVZeroBubble', 'DualPipeV'\]",
        ),
    ],
)
def test_a_bad_plan_is_refused_naming_the_value(arguments: dict[str, object], message: str) -> None:
    given: dict[str, object] = {"split_points": ["blocks.2"], "loss_fn": F.mse_loss} | arguments
    with pytest.raises(ValueError, match=message):
        PipelinePlan(**given)  # type: ignore[arg-type]


def test_the_stages_must_be_the_pipeline_degree_when_fabric_is_built() -> None:
    plan = PipelinePlan(["blocks.1", "blocks.3"], F.mse_loss)
    strategy = ModelParallelStrategy(mesh=MeshPlan(pipeline_parallel=2), pipeline=plan)
    with pytest.raises(ValueError, match=r"makes 3 stages, but the mesh has pipeline_parallel=2"):
        Fabric(accelerator="cpu", devices=4, strategy=strategy)
    one_per_stage = PipelinePlan(["blocks.1", "blocks.3"], F.mse_loss, microbatches=2)
    strategy = ModelParallelStrategy(mesh=MeshPlan(pipeline_parallel=3), pipeline=one_per_stage)
    with pytest.raises(ValueError, match=r"microbatches=2, schedule='1F1B'\) needs at least one microbatch per stage"):
        Fabric(accelerator="cpu", devices=3, strategy=strategy)


@pytest.mark.parametrize(
    ("split_points", "arguments", "message"),
    [
        (
            ["blocks.0", "blocks.1", "blocks.2"],
            {},
            r"makes 4 stages, but the mesh has pipeline_parallel=2: give one split point fewer than the pipeline "
            r"degree, or several stages per rank with a schedule of \['Interleaved1F1B', 'LoopedBFS', "
            r"'InterleavedZeroBubble', 'ZBVZeroBubble', 'DualPipeV'\]",
        ),
        (
            ["blocks.0", "blocks.1"],
            {"schedule": "Interleaved1F1B"},
            r"schedule='Interleaved1F1B'\) makes 3 stages, but the mesh has pipeline_parallel=2: give a multiple "
            r"of the pipeline degree, minus one",
        ),
        (
            ["blocks.0", "blocks.1", "blocks.2", "head", "embedding"],
            {"schedule": "ZBVZeroBubble"},
            r"schedule='ZBVZeroBubble'\) makes 6 stages, but the mesh has pipeline_parallel=2: give 3 split points "
            r"\(two stages per rank\)",
        ),
        (
            ["blocks.0", "blocks.1", "blocks.2"],
            {"schedule": "DualPipeV", "microbatches": 2},
            r"PipelinePlan\(microbatches=2, schedule='DualPipeV'\) needs at least one microbatch per stage \(4\); "
            r"use more microbatches\.",
        ),
        (
            ["blocks.0", "blocks.1", "blocks.2"],
            {"schedule": "InterleavedZeroBubble", "microbatches": 5},
            r"microbatches=5, schedule='InterleavedZeroBubble'\) on pipeline_parallel=2: the schedule runs them in "
            r"rounds of 2",
        ),
        (
            ["blocks.0", "blocks.1", "blocks.2"],
            {"schedule": "Interleaved1F1B", "microbatches": 5},
            r"microbatches=5, schedule='Interleaved1F1B'\) on pipeline_parallel=2: the schedule runs them in "
            r"rounds of 2, so give a multiple of 2",
        ),
    ],
)
def test_stages_that_cannot_be_placed_on_the_pipeline_ranks_are_refused(
    split_points: list[str], arguments: dict[str, object], message: str
) -> None:
    plan = PipelinePlan(split_points, F.mse_loss, **arguments)  # type: ignore[arg-type]
    strategy = ModelParallelStrategy(mesh=MeshPlan(pipeline_parallel=2, data_parallel=1), pipeline=plan)
    with pytest.raises(ValueError, match=message):
        Fabric(accelerator="cpu", devices=2, strategy=strategy)


def test_a_multi_stage_schedule_places_stage_s_on_rank_s_modulo_the_degree() -> None:
    plan = PipelinePlan(["blocks.0", "blocks.1", "blocks.2", "head"], F.mse_loss, schedule="LoopedBFS")
    assert plan.num_stages == 5
    plan = PipelinePlan(["blocks.0", "blocks.1", "blocks.2"], F.mse_loss, schedule="Interleaved1F1B")
    assert [plan.stages_of(rank, 2) for rank in range(2)] == [(0, 2), (1, 3)]
    assert [plan.stages_of(rank, 4) for rank in range(4)] == [(0,), (1,), (2,), (3,)]
    assert plan.microbatch_count == 4  # one per stage: a multiple of the rounds of 2
    assert [plan.rank_of(stage, 2) for stage in range(4)] == [0, 1, 0, 1]


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_a_v_schedule_places_two_stages_per_rank_the_first_rank_holding_the_first_and_the_last(schedule: str) -> None:
    plan = PipelinePlan(["blocks.0", "blocks.1", "blocks.2", "head", "embedding"], F.mse_loss, schedule=schedule)
    assert [plan.stages_of(rank, 3) for rank in range(3)] == [(0, 5), (1, 4), (2, 3)]
    assert [plan.rank_of(stage, 3) for stage in range(6)] == [0, 1, 2, 2, 1, 0]
    assert plan.default_degree == 3  # no degree given: two stages on each rank
    assert plan.splits_backward
    assert not PipelinePlan(["blocks.0"], F.mse_loss, schedule="Interleaved1F1B").splits_backward


def test_pipeline_settings_that_cannot_work_are_refused_at_construction() -> None:
    plan = PipelinePlan(["blocks.2"], F.mse_loss)
    with pytest.raises(ValueError, match=r"state_dict_type='full'\) cannot gather one file on rank 0"):
        ModelParallelStrategy(mesh=MeshPlan(pipeline_parallel=2), pipeline=plan, state_dict_type="full")
    with pytest.raises(ValueError, match=r"pipeline=\['blocks.2'\] is not valid. Accepted: a fabric.strategies"):
        ModelParallelStrategy(pipeline=["blocks.2"])  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"needs parallelize_fn.*\(or a pipeline= plan, or a mesh with context_parallel\)"
    ):
        ModelParallelStrategy(mesh=MeshPlan(tensor_parallel=2))
    strategy = ModelParallelStrategy(mesh=MeshPlan(pipeline_parallel=2, tensor_parallel=2), pipeline=plan)
    with pytest.raises(ValueError, match=r"has tensor_parallel=2 but no parallelize_fn to split the layers"):
        Fabric(accelerator="cpu", devices=4, strategy=strategy)
    strategy = ModelParallelStrategy(pipeline=plan)  # a GradScaler's loss scaling cannot reach the schedule's backward
    with pytest.raises(ValueError, match=r"with precision='16-mixed': .* use '32-true', 'bf16-mixed' or 'bf16-true'"):
        Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="16-mixed")


def test_a_zero_bubble_schedule_keeps_the_gathered_parameters_for_the_weights_backward() -> None:
    """torch computes a zero-bubble stage's weight gradients after its forward; had FSDP freed the gathered
    parameters by then, they would come out None or partial (measured: a gradient norm of 0.25 for 1.00)."""
    plan = PipelinePlan(["blocks.0", "blocks.1", "blocks.2"], F.mse_loss, schedule="ZBVZeroBubble")
    assert ModelParallelStrategy(pipeline=plan).reshard_after_forward is False
    assert ModelParallelStrategy(pipeline=PipelinePlan(["blocks.2"], F.mse_loss)).reshard_after_forward is True
    with pytest.raises(
        ValueError,
        match=r"ModelParallelStrategy\(reshard_after_forward=True\) with PipelinePlan\(schedule='ZBVZeroBubble'\): "
        r".* Leave reshard_after_forward unset \(False under this schedule; as a sharding_strategy: SHARD_GRAD_OP or "
        r"_HYBRID_SHARD_ZERO2, not FULL_SHARD or HYBRID_SHARD\) or pick a schedule of \['GPipe', '1F1B', "
        r"'Interleaved1F1B', 'LoopedBFS'\]",
    ):
        ModelParallelStrategy(pipeline=plan, reshard_after_forward=True)


class ComposerGPT(nn.Module):
    """A Trainer model whose network (``model``) the pipeline cuts: ``forward(batch)`` runs on the first stage."""

    def __init__(self) -> None:
        super().__init__()
        self.model = GPT()

    def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:
        return self.model(batch[0])  # type: ignore[no-any-return]

    def loss(self, logits: torch.Tensor, batch: list[torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())


class FlatComposerGPT(GPT):
    """A Trainer model that is its own network: its forward(batch) cannot run on a later stage's activations."""

    def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return super().forward(batch[0])

    loss = ComposerGPT.loss


@pytest.mark.parametrize(
    ("model", "plan", "arguments", "message"),
    [
        (
            FlatComposerGPT(),
            PipelinePlan(["blocks.2"]),
            {},
            r"split_points=\['blocks.2'\]\) cuts FlatComposerGPT itself, .* inside one submodule it calls \(its "
            r"network, one of \['blocks', 'embedding', 'head'\], e.g. 'model.blocks.2'\)",
        ),
        (
            ComposerGPT(),
            PipelinePlan(["model.blocks.2"], F.mse_loss),
            {},
            r"loss_fn=<function mse_loss .*leave loss_fn",
        ),
        (
            ComposerGPT(),
            PipelinePlan(["model.blocks.2"]),
            {"device_train_microbatch_size": 2},
            r"device_train_microbatch_size=2 cannot be honoured under pipeline parallelism: .*PipelinePlan\(micro",
        ),
        (
            ComposerGPT(),
            PipelinePlan(["model.blocks.2"]),
            {"grad_accum": 2},
            r"grad_accum=2 cannot be honoured under pipeline parallelism: .*leave grad_accum out",
        ),
        (
            ComposerGPT(),
            PipelinePlan(["model.blocks.2"]),
            {"accumulate_train_batch_on_tokens": True},
            r"accumulate_train_batch_on_tokens=True cannot be honoured under pipeline parallelism",
        ),
    ],
)
def test_the_trainer_refuses_what_a_pipeline_cannot_do_when_it_is_built(
    model: nn.Module, plan: PipelinePlan, arguments: dict[str, object], message: str
) -> None:
    from fabric.trainer import Trainer

    strategy = ModelParallelStrategy(pipeline=plan)  # no mesh given: one rank per stage, FSDP over the rest
    fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)
    assert strategy.mesh_plan().degrees == {
        "pipeline_parallel": 2,
        "data_parallel_replicate": 1,
        "data_parallel": 2,
        "context_parallel": 1,
        "tensor_parallel": 1,
    }
    with pytest.raises(ValueError, match=message):
        Trainer(model, fabric=fabric, **arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"split_points": ["model.blocks.2"], "stages": 2}, r"\['pp'\] has \['stages'\]; accepted keys: .*"),
        ({"microbatches": 2}, r"\['pp'\] has no split_points; accepted keys"),
        (
            {"split_points": ["model.blocks.2"], "pipeline_parallel_degree": 4},
            r"\['pp'\]: PipelinePlan\(split_points=\['model.blocks.2'\], schedule='1F1B'\) makes 2 stages, but the "
            r"mesh has pipeline_parallel=4",
        ),
        ({"split_points": ["model.blocks.2"], "schedule": "zb"}, r"\['pp'\]: PipelinePlan\(schedule='zb'\) is not"),
    ],
)
def test_a_bad_pp_section_is_refused_naming_the_key(section: dict[str, object], message: str) -> None:
    from fabric.trainer.parallelism import strategy_from

    with pytest.raises(ValueError, match=message):
        strategy_from({"pp": section}, ComposerGPT())


def test_a_pp_section_describes_pipeline_stages_with_sharded_checkpoints() -> None:
    from fabric.trainer.parallelism import strategy_from

    strategy = strategy_from(
        {"pp": {"split_points": ["model.blocks.2"], "microbatches": 4, "schedule": "GPipe"}}, ComposerGPT()
    )
    assert isinstance(strategy, ModelParallelStrategy)
    assert strategy.pipeline == PipelinePlan(["model.blocks.2"], microbatches=4, schedule="GPipe")
    assert strategy.state_dict_type == "sharded"  # no rank holds the whole model: Composer's "full" cannot be
    assert strategy.planned_mesh().pipeline_parallel == 2  # one rank per stage
    with pytest.raises(ValueError, match=r"state_dict_type='full'\) cannot gather one file on rank 0"):
        strategy_from({"pp": {"split_points": ["model.blocks.2"]}, "fsdp": {"state_dict_type": "full"}}, ComposerGPT())
    four_stages = {"split_points": ["model.blocks.1", "model.blocks.2", "model.blocks.3"], "schedule": "LoopedBFS"}
    strategy = strategy_from({"pp": four_stages | {"pipeline_parallel_degree": 2}}, ComposerGPT())
    assert strategy.planned_mesh().pipeline_parallel == 2  # two stages on each pipeline rank
    custom = {"split_points": ["model.blocks.2"], "stage_forward": GPT.forward, "every_stage": ["model.head"]}
    strategy = strategy_from({"pp": custom}, ComposerGPT())
    assert strategy.pipeline == PipelinePlan(["model.blocks.2"], stage_forward=GPT.forward, every_stage=("model.head",))


# --- the cut -------------------------------------------------------------------------------------------


def test_each_stage_keeps_its_parts_under_the_models_own_names() -> None:
    names = _parameter_names(GPT())
    stages = []
    for stage in range(3):
        model = GPT()
        keep_stages(model, stage_parts(model, ["blocks.1", "blocks.3"]), (stage,))
        stages.append(_parameter_names(model))
    assert stages[0] == ["embedding.weight", "blocks.0.weight", "blocks.0.bias"]
    assert stages[1] == ["blocks.1.weight", "blocks.1.bias", "blocks.2.weight", "blocks.2.bias"]
    assert stages[2] == ["blocks.3.weight", "blocks.3.bias", "head.weight", "head.bias"]
    assert sorted(itertools.chain(*stages)) == sorted(names)  # every parameter in exactly one stage


def test_stages_chained_compute_what_the_whole_model_computes() -> None:
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 2))
    stages = []
    for stage in range(2):
        model = nn.Sequential(*whole)  # the same layers, so the same weights
        keep_stages(model, stage_parts(model, ["2"]), (stage,))
        stages.append(model)
    inputs = torch.randn(4, 3)
    assert torch.equal(stages[1](stages[0](inputs)), whole(inputs))
    assert list(dict(stages[1].named_children())) == ["2", "3", "4"]  # a Sequential keeps its indexes as names


def test_a_rank_with_several_stages_runs_each_through_a_view_sharing_the_models_parts() -> None:
    torch.manual_seed(0)
    whole = GPT()
    model = GPT()
    model.load_state_dict(whole.state_dict())
    parts = stage_parts(model, ["blocks.0", "blocks.1", "blocks.3"])
    keep_stages(model, parts, (0, 2))  # what rank 0 of 2 keeps
    assert _parameter_names(model) == [*_parameter_names(whole)[:1], *_parameter_names(whole)[3:7]]
    views = [stage_view(model, parts, stage) for stage in (0, 2)]
    assert _parameter_names(views[0]) == ["embedding.weight"]
    assert _parameter_names(views[1]) == ["blocks.1.weight", "blocks.1.bias", "blocks.2.weight", "blocks.2.bias"]
    assert views[1].blocks[1] is model.blocks[1]  # the parts are shared: one set of parameters, the model's
    assert views[1].blocks is not model.blocks and len(model.blocks) == 2  # the containers are the view's own
    views[0].register_forward_hook(lambda *_: None)  # e.g. FSDP's, on the view as its root
    assert not model._forward_hooks
    model.register_buffer("scale", torch.ones(2))
    views[0].scale = torch.zeros(2)  # as materialising a meta buffer through one view does: the model's is replaced
    assert model.scale is views[0].scale is views[1].scale
    rest = GPT()
    rest.load_state_dict(whole.state_dict())
    keep_stages(rest, parts, (1, 3))
    stage_1, stage_3 = (stage_view(rest, parts, stage) for stage in (1, 3))
    tokens = torch.randint(0, 10, (2, 3))
    assert torch.allclose(stage_3(views[1](stage_1(views[0](tokens)))), whole(tokens))


class Wrapper(nn.Module):
    """A model around a network, with a parameterless part beside it (a loss module), as Trainer models have."""

    def __init__(self, post_process: bool = False) -> None:
        super().__init__()
        self.model = GPT()
        self.criterion = nn.CrossEntropyLoss()
        self.post_process = post_process

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.model(batch["tokens"])
        return logits.softmax(-1) if self.post_process else logits


def test_a_named_network_alone_is_cut_and_the_stages_run_the_models_forward_then_the_network() -> None:
    torch.manual_seed(0)
    whole = Wrapper()
    stages = [Wrapper() for _ in range(2)]
    for stage, model in enumerate(stages):
        model.load_state_dict(whole.state_dict())
        keep_stages(model, stage_parts(model, ["model.blocks.2"], network="model"), (stage,))
        assert isinstance(model.criterion, nn.CrossEntropyLoss)  # outside the network: kept on every stage
        StageForward(model, "model", stage)
    assert _parameter_names(stages[1]) == [f"model.{name}" for name in _parameter_names(GPT())][5:]
    batch = {"tokens": torch.randint(0, 10, (3, 5)), "name": "a leaf that is no tensor"}
    tensors = StageForward(stages[0], "model", 0).flatten((batch,), {})  # the tensors torch's stage is given
    assert len(tensors) == 1
    # the first stage rebuilds the dict around its microbatch and runs Wrapper.forward; the next runs the network
    assert torch.allclose(stages[1](stages[0](*tensors)), whole(batch))


def test_a_first_stage_whose_forward_changes_the_networks_output_is_refused() -> None:
    model = Wrapper(post_process=True)
    keep_stages(model, stage_parts(model, ["model.blocks.2"], network="model"), (0,))
    first = StageForward(model, "model", 0)
    tensors = first.flatten(({"tokens": torch.randint(0, 10, (3, 5))},), {})
    with pytest.raises(ValueError, match=r"Wrapper.forward must call its network once and return its output as it is"):
        model(*tensors)


def test_a_parameter_outside_the_named_network_is_refused() -> None:
    model = Wrapper()
    model.scale = nn.Parameter(torch.ones(()))
    with pytest.raises(ValueError, match=r"Wrapper holds the parameter 'scale' outside its network 'model'"):
        keep_stages(model, stage_parts(model, ["model.blocks.2"], network="model"), (0,))
    with pytest.raises(ValueError, match=r"PipelinePlan\(network='net'\) is not valid with split_points="):
        PipelinePlan(["model.blocks.2"], network="net")


@pytest.mark.parametrize(
    ("split_points", "message"),
    [
        (["blocks.7"], r"'blocks.7' names no submodule of GPT \(its top-level modules: embedding, blocks, head\)"),
        (["blocks.3", "blocks.1"], r"are not in the order the model registers its submodules"),
        (["blocks", "blocks.1"], r"'blocks' contains another split point"),
    ],
)
def test_a_split_point_that_cannot_cut_the_model_is_named(split_points: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        stage_parts(GPT(), split_points)


def test_parts_kept_on_every_stage_must_be_parts_without_parameters() -> None:
    class Rotary(GPT):
        def __init__(self) -> None:
            super().__init__()
            self.rotary = nn.Identity()  # registered last: the last stage's part, unless kept on every stage

    parts = stage_parts(Rotary(), ["blocks.2"], every_stage=("rotary",))
    for stage in range(2):
        model = Rotary()
        keep_stages(model, parts, (stage,))
        assert isinstance(model.rotary, nn.Identity)
    with pytest.raises(ValueError, match=r"every_stage=...\): 'blocks.0' holds the parameter 'weight', which belongs"):
        stage_parts(Rotary(), ["blocks.2"], every_stage=("blocks.0",))
    with pytest.raises(ValueError, match=r"'rope' is not one of the parts .* \(they are: embedding, blocks.0, "):
        stage_parts(Rotary(), ["blocks.2"], every_stage=("rope",))
    with pytest.raises(ValueError, match=r"PipelinePlan\(every_stage='rotary'\) is not valid. Accepted: a sequence"):
        PipelinePlan(["blocks.2"], every_stage="rotary")
    with pytest.raises(ValueError, match=r"PipelinePlan\(stage_forward=3\) is not valid. Accepted: \(module, \*inputs"):
        PipelinePlan(["blocks.2"], stage_forward=3)  # type: ignore[arg-type]


def test_a_stage_forward_runs_in_place_of_the_models_own_on_every_stage() -> None:
    def stage_forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:  # what a forward that skips None would do
        x = model.embedding(x) if model.embedding is not None else x
        for block in model.blocks:
            x = block(x)
        return model.head(x) if model.head is not None else x

    class Unskipping(GPT):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks[-1](self.embedding(tokens)))  # calls parts of every stage

    torch.manual_seed(0)
    whole = GPT()
    stages = []
    for stage in range(2):
        model = Unskipping()
        model.load_state_dict(whole.state_dict())
        keep_stages(model, stage_parts(model, ["blocks.2"]), (stage,))
        StageForward(model, "", stage, stage_forward)
        stages.append(model)
    tokens = torch.randint(0, 10, (2, 3))
    first = StageForward(stages[0], "", 0, stage_forward)
    assert torch.allclose(stages[1](stages[0](*first.flatten((tokens,), {}))), whole(tokens))


def test_a_parameter_no_stage_can_own_is_named() -> None:
    model = GPT()
    model.position = nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=r"GPT holds the parameter 'position' itself.*move it into a submodule"):
        keep_stages(model, stage_parts(model, ["blocks.2"]), (0,))


# --- Fabric's loop on 2 ranks ----------------------------------------------------------------------------


@pytest.fixture(
    scope="module",
    params=[
        "1F1B",
        "GPipe",
        "Interleaved1F1B",
        "LoopedBFS",
        "InterleavedZeroBubble",
        "ZBVZeroBubble",
        "DualPipeV",
        "InterleavedZeroBubble-own-fsdp",  # 2 stages parallelize_fn shards with reshard_after_forward=True
        "ZBVZeroBubble-checkpointed",  # activation_checkpointing={nn.Linear}: recomputed for both backwards
    ],
)
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp(f"pipeline-{request.param}")
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), request.param], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out, request.param


def _reference() -> dict[str, object]:
    """One process, the whole batch of each step: what both ranks together must compute."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import pipeline_job_reference as reference
    finally:
        sys.path.pop(0)
    return reference.run()


def test_two_ranks_of_stages_train_like_one_process(job: tuple[Path, str]) -> None:
    out, schedule = job
    first, last = (torch.load(out / f"rank-{rank}.pt") for rank in (0, 1))
    reference = _reference()
    assert first["losses"] == last["losses"]  # the last stage's loss reaches the first
    assert first["losses"] == pytest.approx(reference["losses"], rel=1e-6)
    assert first["norms"] == last["norms"]  # one norm over both stages' gradients
    assert first["norms"] == pytest.approx(reference["norms"], rel=1e-6)
    assert max(reference["norms"]) > 0.5  # the clip really clipped  # type: ignore[type-var]
    weights = first["weights"] | last["weights"]
    assert sorted(weights) == sorted(reference["weights"])  # type: ignore[arg-type]
    for name, value in reference["weights"].items():  # type: ignore[attr-defined]
        assert torch.allclose(weights[name], value, atol=1e-6), name
    # each rank's optimizer holds its own stages' parameters only: layers 0 (and 2, with 4 stages; 4 in a V) on rank 0
    if schedule in ("1F1B", "GPipe", "InterleavedZeroBubble-own-fsdp"):
        assert sorted(first["weights"]) == ["0.bias", "0.weight"]
        assert (first["optimizer_parameters"], last["optimizer_parameters"]) == (2, 4)
    elif schedule.partition("-")[0] in V_SCHEDULES:
        assert sorted(first["weights"]) == ["0.bias", "0.weight", "4.bias", "4.weight"]
        assert (first["optimizer_parameters"], last["optimizer_parameters"]) == (4, 2)
    else:
        assert sorted(first["weights"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert (first["optimizer_parameters"], last["optimizer_parameters"]) == (4, 2)


def test_evaluation_gives_the_loss_everywhere_and_the_output_on_the_last_stage(job: tuple[Path, str]) -> None:
    out, schedule = job
    ranks = [torch.load(out / f"rank-{rank}.pt") for rank in (0, 1)]
    reference = _reference()
    assert ranks[0]["eval_loss"] == ranks[1]["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-6)
    holder = 0 if schedule.partition("-")[0] in V_SCHEDULES else 1  # a V ends on the first rank
    assert ranks[1 - holder]["eval_output"] is None
    assert torch.allclose(ranks[holder]["eval_output"], reference["eval_output"], atol=1e-6)  # type: ignore[arg-type]


def test_the_loops_misuses_are_refused_in_one_line(job: tuple[Path, str]) -> None:
    out, _ = job
    messages = torch.load(out / "rank-0.pt")["messages"]
    assert "needs the target: call model(inputs, target=targets), or run under torch.no_grad()" in messages["no target"]
    assert "A batch of 6 samples does not split into 4 equal microbatches" in messages["uneven batch"]
    assert "fabric.backward takes only the loss that call returned" in messages["other tensor"]
    assert "a Hugging Face folder: each rank holds only its pipeline stages" in messages["huggingface"]


# --- a Hugging Face model on 2 ranks, through a stage forward -------------------------------------------------------


def _run_huggingface(out: Path, mode: str) -> None:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    command = [sys.executable, str(HUGGINGFACE_SCRIPT), str(out), mode]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="module")
def huggingface_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.engines import require_modules

    require_modules("a Hugging Face Llama", "transformers")
    out = tmp_path_factory.mktemp("pipeline-huggingface")
    for mode in ("reference", "1F1B", "Interleaved1F1B"):
        _run_huggingface(out, mode)
    return out


@pytest.mark.end_to_end
@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_a_hugging_face_llama_trains_on_stages_like_one_process_and_its_checkpoint_loads_back(
    huggingface_runs: Path, schedule: str
) -> None:
    """LlamaModel.forward calls its embedding and norm whatever the stage: the plan's stage_forward runs each stage,
    every_stage keeps the rotary embedding (no parameters) on both ranks; 2 stages, or 4 on the 2 ranks."""
    reference = torch.load(huggingface_runs / "reference.pt")
    report = torch.load(huggingface_runs / f"{schedule}.pt")
    assert report["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert sorted(report["weights"]) == sorted(reference["weights"])  # the model's own names, every stage's
    for name, value in reference["weights"].items():
        assert torch.allclose(report["weights"][name], value, atol=1e-4), name
    consolidated = huggingface_runs / f"consolidated-{schedule}.pt"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fabric_cli",
            "consolidate",
            str(huggingface_runs / f"ckpt-{schedule}"),
            str(consolidated),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    sys.path.insert(0, str(HUGGINGFACE_SCRIPT.parent))
    try:
        from pipeline_huggingface_job import make_model
    finally:
        sys.path.pop(0)
    fresh = make_model()
    fresh.load_state_dict(torch.load(consolidated, weights_only=True)["model"])  # strict: every name, nothing else
    for name, value in fresh.named_parameters():
        assert torch.equal(value, report["weights"][name]), name
