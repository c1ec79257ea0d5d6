"""Context parallelism: refused where torch cannot shard attention (CPU), wired for CUDA, and proven on 4 real gloo
ranks with CUDA faked at its boundary (tests/scripts/context_parallel_job.py): the device check and torch's
``context_parallel`` itself, replaced by an exact split of the sequence for a model that works on each position alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fabric import Fabric
from fabric.strategies import MeshPlan, ModelParallelStrategy, PipelinePlan
from fabric.strategies.context_parallel import refusal, sequence_sharded

SCRIPT = Path(__file__).parents[1] / "scripts" / "context_parallel_job.py"


def test_context_parallelism_on_the_cpu_is_refused_naming_cuda_and_the_kernel() -> None:
    strategy = ModelParallelStrategy(mesh=MeshPlan(data_parallel=1, context_parallel=2))  # no parallelize_fn needed
    with pytest.raises(
        ValueError,
        match=r"MeshPlan\(context_parallel=2\) needs CUDA \(got 'cpu'\): torch's context_parallel shards the CUDA "
        r"attention kernels only \(on CPU aten._scaled_dot_product_flash_attention_for_cpu has no sharding strategy",
    ):
        Fabric(accelerator="cpu", devices=2, strategy=strategy)


def test_cuda_is_accepted_and_pipeline_stages_with_it_are_refused() -> None:
    assert refusal(2, "cuda", pipelined=False) is None
    assert refusal(1, "cpu", pipelined=True) is None  # no context parallelism: nothing to refuse
    assert refusal(2, "cuda", pipelined=True) == (
        "MeshPlan(context_parallel=2) with pipeline stages is not wired yet; use one or the other."
    )
    strategy = ModelParallelStrategy(
        mesh=MeshPlan(pipeline_parallel=2, context_parallel=2),
        pipeline=PipelinePlan(["1"], torch.nn.functional.mse_loss),
    )
    with pytest.raises(ValueError, match=r"context_parallel=2\) needs CUDA"):  # on this CPU, the device first
        Fabric(accelerator="cpu", devices=4, strategy=strategy)


def test_without_context_parallelism_the_context_leaves_the_buffers_whole() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    tokens = torch.arange(12).view(2, 6)
    with fabric.context_parallel([tokens], seq_dims=[1]):
        assert tokens.shape == (2, 6)  # one loop runs on every mesh


def test_each_buffer_needs_its_sequence_dimension() -> None:
    context = sequence_sharded(None, [torch.ones(2, 4), torch.ones(2, 4)], [1], [])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"got 2 buffers and 1 seq_dims: give each buffer the dimension"):
        context.__enter__()


def _run(out: Path, mode: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(out), mode], capture_output=True, text=True, timeout=300, env=env
    )


def test_the_parts_of_each_sequence_train_like_one_process_on_the_whole_batch(tmp_path: Path) -> None:
    for mode in ("reference", "train"):
        done = _run(tmp_path, mode)
        assert done.returncode == 0, done.stderr[-4000:]
    report, reference = torch.load(tmp_path / "train.pt"), torch.load(tmp_path / "reference.pt")
    # data_parallel=2 x context_parallel=2: two data shares, each read by both ranks of a context-parallel group
    assert report["shares"] == [[2, 0], [2, 0], [2, 1], [2, 1]]
    # inside the context each rank holds half of every sequence; on exit the inputs are whole again, the targets
    # (no_restore) stay split
    assert report["seen"][0] == {"mesh": ("context_parallel",), "shapes": [(2, 3, 8), (2, 3, 4)]}
    assert report["restored"] == [((2, 6, 8), (2, 3, 4))] * 3
    # FSDP shards over data_parallel x context_parallel, so the halves' gradients are averaged as the shares' are
    assert report["shard_meshes"] == {("data_parallel_context_parallel",)}
    assert report["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    for name, value in reference["weights"].items():
        assert torch.allclose(report["weights"][name], value, atol=1e-6), name


def test_ranks_of_a_context_parallel_group_given_different_batches_are_stopped(tmp_path: Path) -> None:
    done = _run(tmp_path, "different")
    assert done.returncode != 0
    assert "Ranks 0 and 1 hold parts of one model copy (context_parallel=2) and must be given the same batches" in (
        done.stderr
    )


def test_the_trainer_splits_the_sequences_its_cp_section_names_and_trains_like_one_process(tmp_path: Path) -> None:
    for mode in ("reference", "trainer"):
        done = _run(tmp_path, mode)
        assert done.returncode == 0, done.stderr[-4000:]
    report, reference = torch.load(tmp_path / "trainer.pt"), torch.load(tmp_path / "reference.pt")
    # seq_dims {0: 1, 1: 1}: the inputs and the targets of each batch, halved along the sequence, every step
    assert report["seen"] == [{"mesh": ("context_parallel",), "shapes": [(2, 3, 8), (2, 3, 4)]}] * 3
    assert report["loss"] == pytest.approx(reference["losses"][-1], rel=1e-5)  # the parts' mean: the batch's
    for name, value in reference["weights"].items():
        assert torch.allclose(report["weights"][name], value, atol=1e-6), name
    assert (report["timestamp"]["batch"], report["timestamp"]["sample"]) == (3, 12)  # the whole batches counted


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"context_parallel_degree": 2}, r"\['cp'\] needs seq_dims: the batch entries that hold sequences"),
        ({"context_parallel_degree": 0, "seq_dims": {0: 1}}, r"context_parallel_degree=0\). Accepted keys"),
        ({"context_parallel_degree": 2, "seq_dims": {0: -1}}, r"\['seq_dims'\]=\{0: -1\} is not valid"),
        ({"context_parallel_degree": 2, "seq_dims": {0: 1}, "ring": True}, r"is not valid \(\['ring'\]\)"),
    ],
)
def test_a_bad_cp_section_is_refused_naming_the_key(section: dict[str, object], message: str) -> None:
    from fabric.trainer.parallelism import sequence_split_from

    with pytest.raises(ValueError, match=message):
        sequence_split_from({"cp": section})


def test_the_named_batch_entries_must_hold_tensors() -> None:
    from fabric.trainer.parallelism import sequence_split_from

    split = sequence_split_from({"cp": {"context_parallel_degree": 2, "seq_dims": {"input_ids": 1, 2: 1}}})
    assert split is not None
    tokens = torch.zeros(2, 6)
    assert split.tensors({"input_ids": tokens, 2: tokens}, torch.nn.Linear(1, 1)) == ([tokens, tokens], [1, 1])
    with pytest.raises(ValueError, match=r"names the batch entry 'input_ids', but this list batch holds NoneType"):
        split.tensors([tokens], torch.nn.Linear(1, 1))
