"""Every mesh shape trains like one process, and a checkpoint saved on one shape continues on the next.

Real gloo processes (tests/scripts/mesh_job.py): a small causal transformer trains 3 AdamW steps on each shape of a
chain (HSDP, TP, pipeline stages and their combinations, then shrinking 8 -> 4 -> 2 -> 1 processes), each launch also
loading the checkpoint the previous shape saved and training 2 steps more; Composer's Trainer
trains the same steps from a ``parallelism_config``, and Lightning's ``FSDPStrategy(sharding_strategy="HYBRID_SHARD",
device_mesh=(2, 2))`` off the chain. A plain-torch
process that sees each step's whole global batch is the reference (tolerances: float32 reduction order).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

#: Slow: every mesh shape on 4 real ranks against one process (`bash scripts/test.sh --end-to-end`; CI runs it).
pytestmark = pytest.mark.end_to_end

SCRIPT = Path(__file__).parents[1] / "scripts" / "mesh_job.py"
#: (pipeline, replicate, shard, tensor[, variant]) in launch order; each loads the checkpoint of the one before it.
#: Pipelines: 2 stages with 1F1B, 4 with GPipe; variants with 4 stages on 2 ranks: ``v2`` interleaved (Interleaved1F1B),
#: ``zbv`` and ``dpv`` in a V (ZBVZeroBubble, DualPipeV) (tests/scripts/mesh_job.py's CUTS).
Shape = tuple[int | str, ...]
CHAIN: list[Shape] = [
    (1, 2, 2, 1),
    (1, 4, 1, 1),
    (1, 1, 4, 1),  # plain FSDP2 over the 4 ranks (HSDP 1 x 4)
    (1, 1, 2, 2),
    (1, 2, 1, 2),
    (1, 2, 2, 2),
    (1, 2, 4, 1),
    (2, 1, 2, 1),  # PP x FSDP, from 8 processes to 4
    (2, 2, 1, 1),  # PP x replicas (HSDP 2 x 1)
    (2, 1, 1, 2),  # PP x TP
    (2, 1, 2, 1, "v2"),  # 2 stages per pipeline rank, interleaved, x FSDP
    (2, 1, 1, 2, "v2"),  # and x TP
    (2, 1, 2, 1, "zbv"),  # 2 stages per pipeline rank in a V, zero bubble, x FSDP
    (2, 2, 1, 1, "zbv"),  # and x replicas
    (2, 1, 1, 2, "dpv"),  # DualPipeV x TP
    (4, 1, 1, 1),
    (2, 1, 1, 1),  # 4 stages to 2 processes
    (1, 1, 1, 1),  # and to one
]
#: Lightning's front end of HSDP, ``FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2))``, off the
#: chain: (pipeline, replicate, shard, tensor, variant) with the variant that names it in tests/scripts/mesh_job.py.
LIGHTNING_SHAPE: Shape = (1, 2, 2, 1, "lightning")
#: Composer's Trainer with parallelism_config: HSDP (both degrees given) x a tp section's layer plan.
TRAINER_SHAPE = (2, 1, 2)
#: The Trainer on pipeline stages (pipeline, shard, tensor): PP x FSDP from parallelism_config's pp section, PP x TP
#: from strategy=ModelParallelStrategy(..., pipeline=PipelinePlan(...)).
#: and with 2 stages per rank (pipeline, shard, tensor, variant), interleaved or in a V, from the pp section.
TRAINER_PIPELINES: list[Shape] = [(2, 2, 1), (2, 1, 2), (2, 2, 1, "v2"), (2, 2, 1, "zbv")]
LOSS_TOLERANCE, WEIGHT_TOLERANCE = 1e-5, 2e-5


def _tag(shape: Shape) -> str:
    """The job's name for a shape: ``REPLICATExSHARDxTENSOR``, prefixed ``ppN`` with pipeline stages (and the
    variant, e.g. ``pp2v2``), or by the variant of a front end without them (``lightning-2x2x1``)."""
    if len(shape) == 3:
        return "x".join(map(str, shape))
    pipeline, replicate, shard, tensor, *variant = shape
    rest = "x".join(map(str, (replicate, shard, tensor)))
    if pipeline == 1:
        return f"{variant[0]}-{rest}" if variant else rest
    return f"pp{pipeline}{''.join(map(str, variant))}x{rest}"


def _job_arguments(shape: Shape) -> list[str]:
    """``PIPELINE REPLICATE SHARD TENSOR`` for tests/scripts/mesh_job.py (``PIPELINE`` followed by the variant)."""
    pipeline, replicate, shard, tensor, *variant = shape
    return [f"{pipeline}{''.join(map(str, variant))}", *map(str, (replicate, shard, tensor))]


def _trainer_tag(shape: Shape) -> str:
    """The job's name for the Trainer on pipeline stages ``(pipeline, shard, tensor[, variant])``."""
    pipeline, shard, tensor, *variant = shape
    return _tag((pipeline, 1, shard, tensor, *variant))


def _run(*args: str) -> None:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder holding the one-process reference (``reference.pt``), where the meshes' jobs write too."""
    out = tmp_path_factory.mktemp("meshes")
    _run(str(out), "reference")
    return out


@pytest.fixture(scope="module")
def runs(reference_run: Path) -> Path:
    out = reference_run
    previous: str | None = None
    for shape in CHAIN:
        _run(str(out), "train", *_job_arguments(shape), *([previous] if previous else []))
        previous = str(out / f"ckpt-{_tag(shape)}")
    _run(str(out), "trainer", *map(str, TRAINER_SHAPE))
    for pipeline, shard, tensor, *variant in TRAINER_PIPELINES:
        stages, _replicate, *degrees = _job_arguments((pipeline, 1, shard, tensor, *variant))
        _run(str(out), "trainer-pp", stages, *degrees)
    _run(str(out), "trainer-resume", str(out / f"trainer-ckpt-{_trainer_tag(TRAINER_PIPELINES[0])}" / "ba3"))
    return out


def _max_difference(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    assert sorted(first) == sorted(second)
    return max((first[name] - second[name]).abs().max().item() for name in first)


def _assert_trains_like_one_process(out: Path, shape: Shape) -> None:
    """The mesh ``shape`` built, its data shares, and its 3 steps' losses and weights against the reference's."""
    pipeline, replicate, shard, tensor = (int(degree) for degree in shape[:4])
    report = torch.load(out / f"{_tag(shape)}.pt")
    reference = torch.load(out / "reference.pt")
    built = {"pipeline_parallel": pipeline, "data_parallel_replicate": replicate}
    built = {name: degree for name, degree in built.items() if degree > 1}  # built only when above 1
    assert report["mesh"] == built | {"data_parallel": shard, "tensor_parallel": tensor}
    # data splits over replicate x shard; the ranks of a tensor-parallel group (neighbours) and of a pipeline share
    assert report["data_parallel_shards"] == [
        [replicate * shard, (rank // tensor) % (replicate * shard)]
        for rank in range(pipeline * replicate * shard * tensor)
    ]
    assert report["losses"] == pytest.approx(reference["losses"][:3], rel=LOSS_TOLERANCE)
    assert _max_difference(report["weights"], reference["weights"]) < WEIGHT_TOLERANCE
    assert _max_difference(reference["weights"], reference["final"]) > 1e-3  # the steps really moved the weights


@pytest.mark.parametrize("shape", CHAIN, ids=_tag)
def test_the_shape_trains_like_one_process(runs: Path, shape: Shape) -> None:
    _assert_trains_like_one_process(runs, shape)


def test_lightnings_hybrid_shard_device_mesh_trains_like_one_process(reference_run: Path) -> None:
    # FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2), auto_wrap_policy={Block}) on 4 gloo ranks
    _run(str(reference_run), "train", *_job_arguments(LIGHTNING_SHAPE))
    _assert_trains_like_one_process(reference_run, LIGHTNING_SHAPE)


@pytest.mark.parametrize(
    "index", range(1, len(CHAIN)), ids=lambda index: f"{_tag(CHAIN[index - 1])}->{_tag(CHAIN[index])}"
)
def test_a_checkpoint_of_one_shape_continues_on_the_next_like_one_process(runs: Path, index: int) -> None:
    saved = torch.load(runs / f"{_tag(CHAIN[index - 1])}.pt")
    report = torch.load(runs / f"{_tag(CHAIN[index])}.pt")
    reference = torch.load(runs / "reference.pt")
    for name, value in saved["weights"].items():  # loaded exactly as the other shape saved it
        assert torch.equal(report["loaded_weights"][name], value), name
    assert report["resumed_losses"] == pytest.approx(reference["losses"][3:], rel=LOSS_TOLERANCE)
    assert _max_difference(report["final"], reference["final"]) < WEIGHT_TOLERANCE


def test_the_trainer_with_composers_parallelism_config_trains_like_one_process(runs: Path) -> None:
    report = torch.load(runs / f"trainer-{_tag(TRAINER_SHAPE)}.pt")
    reference = torch.load(runs / "reference.pt")
    assert report["strategy"] == "ModelParallelStrategy"  # the tp section's layer plan, HSDP over the degrees
    assert _max_difference(report["weights"], reference["weights"]) < WEIGHT_TOLERANCE
    # the samples trained, each counted once: the 2 ranks of a tensor-parallel group train the same batch
    assert (report["timestamp"]["batch"], report["timestamp"]["sample"]) == (3, 3 * 8)


@pytest.mark.parametrize("shape", TRAINER_PIPELINES, ids=_trainer_tag)
def test_the_trainer_on_pipeline_stages_trains_and_evaluates_like_one_process(runs: Path, shape: Shape) -> None:
    report = torch.load(runs / f"trainer-{_trainer_tag(shape)}.pt")
    reference = torch.load(runs / "reference.pt")
    assert report["strategy"] == "ModelParallelStrategy"
    # the model's network cut into stages: its weights, every stage's, are the reference's after the same 3 steps
    assert _max_difference(report["weights"], reference["weights"]) < WEIGHT_TOLERANCE
    # the loss and the train metric of the last batch (the last stage's, per microbatch) are the global batch's
    assert report["loss"] == pytest.approx(reference["losses"][2], rel=LOSS_TOLERANCE)
    assert report["metrics"]["metrics/train/cross_entropy"] == pytest.approx(reference["losses"][2], rel=LOSS_TOLERANCE)
    # evaluation of 10 samples in batches of 4 (ragged last batches: 5 per share with FSDP 2) is the reference's
    assert report["metrics"]["metrics/eval/cross_entropy"] == pytest.approx(reference["eval_loss"], rel=LOSS_TOLERANCE)
    assert (report["timestamp"]["batch"], report["timestamp"]["sample"]) == (3, 3 * 8)


def test_a_checkpoint_the_trainer_saved_on_pipeline_stages_continues_in_one_process_like_the_reference(
    runs: Path,
) -> None:
    report = torch.load(runs / "trainer-resumed.pt")
    reference = torch.load(runs / "reference.pt")
    # PP 2 x FSDP 2 saved after 3 batches (every stage's parameters and AdamW state); one process trains batches 4-5
    assert (report["timestamp"]["batch"], report["timestamp"]["sample"]) == (5, 5 * 8)
    assert _max_difference(report["final"], reference["final"]) < WEIGHT_TOLERANCE


@pytest.mark.parametrize("shape", [(1, 2, 2, 2), (2, 1, 1, 2), (2, 1, 2, 1, "v2"), (2, 1, 2, 1, "zbv")], ids=_tag)
def test_consolidate_writes_the_weights_the_mesh_saved(runs: Path, shape: Shape) -> None:
    checkpoint = runs / f"ckpt-{_tag(shape)}"
    output = runs / f"consolidated-{_tag(shape)}.pt"
    done = subprocess.run(
        [sys.executable, "-m", "fabric_cli", "consolidate", str(checkpoint), str(output)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    consolidated = torch.load(output, weights_only=True)
    saved = torch.load(runs / f"{_tag(shape)}.pt")["weights"]  # every stage's
    assert consolidated["step"] == 3
    assert sorted(consolidated["model"]) == sorted(saved)
    for name, value in saved.items():
        assert torch.equal(consolidated["model"][name], value), name
