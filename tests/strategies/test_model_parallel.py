"""ModelParallelStrategy: tensor parallelism x FSDP2 on real CPU ranks (gloo), and its checkpoints across mesh shapes.

Three launches (tests/scripts/model_parallel_job.py): a 2x2 mesh on 4 processes trains and saves; TP=2 on 2
ranks trains and loads the 2x2 checkpoint; one process with a plain Fabric loads it too. Tests assert on
what they wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.strategies.model_parallel import ModelParallelStrategy, lightning_mesh

SCRIPT = Path(__file__).parents[1] / "scripts" / "model_parallel_job.py"
ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> None:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model_parallel")
    _run(str(out), "train", "2", "2")
    _run(str(out), "train", "1", "2", str(out / "ckpt-2x2"))
    _run(str(out), "load1", str(out / "ckpt-2x2"))
    return out


def _report(out: Path, tag: str) -> dict:
    return json.loads((out / f"train-{tag}.json").read_text())


def test_tensor_parallel_on_two_ranks_trains_like_one_process(jobs: Path) -> None:
    report = _report(jobs, "1x2")
    assert report["mesh"] == [1, 2]
    assert report["local_rows_of_first_layer"] == 8  # the Colwise layer's 16 output rows split over 2 ranks
    assert report["max_diff_to_reference"] < 1e-5  # parameters and Adam state after 3 steps, clipped
    assert report["norms"] == pytest.approx(report["reference_norms"], rel=1e-5)
    assert max(report["reference_norms"]) > 0.5  # the clip really clipped
    for step in report["batches_seen"]:
        assert step[0] == step[1]  # both ranks of the tensor-parallel group read the same batch


def test_a_2x2_mesh_on_four_processes_trains_like_one_process(jobs: Path) -> None:
    report = _report(jobs, "2x2")
    assert report["world_size"] == 4 and report["mesh"] == [2, 2]
    assert report["local_rows_of_first_layer"] == 4  # 16 rows: tensor parallel 2, then FSDP 2
    assert report["max_diff_to_reference"] < 1e-5
    assert report["norms"] == pytest.approx(report["reference_norms"], rel=1e-5)
    for step in report["batches_seen"]:  # ranks 0,1 form one tensor-parallel group, 2,3 the other
        assert step[0] == step[1] and step[2] == step[3] and step[0] != step[2]


def test_a_2x2_checkpoint_loads_on_a_tensor_parallel_mesh_of_two(jobs: Path) -> None:
    saved = torch.load(jobs / "train-2x2.pt")
    loaded = torch.load(jobs / "loaded-1x2.pt")
    assert sorted(loaded) == sorted(saved)
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key
    assert _report(jobs, "1x2")["loaded_step"] == 3


def test_a_2x2_checkpoint_loads_in_one_process(jobs: Path) -> None:
    saved = torch.load(jobs / "train-2x2.pt")
    loaded = torch.load(jobs / "load1.pt")
    assert sorted(loaded) == sorted(saved)  # parameters and Adam's exp_avg
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key


def _identity(model: nn.Module, mesh: object) -> nn.Module:
    return model


@pytest.mark.parametrize(
    ("world", "nodes", "dp", "tp", "expected"),
    [
        (4, 1, "auto", "auto", (1, 4)),
        (4, 2, "auto", "auto", (2, 2)),
        (4, 1, 2, "auto", (2, 2)),
        (6, 1, "auto", 3, (2, 3)),
    ],
)
def test_mesh_sizes_resolve(world: int, nodes: int, dp: object, tp: object, expected: tuple[int, int]) -> None:
    plan = lightning_mesh(nodes, dp, tp).resolve(world)  # type: ignore[arg-type]
    assert (plan.data_parallel, plan.tensor_parallel) == expected


def test_mesh_sizes_that_do_not_make_the_world_size_fail_at_construction() -> None:
    with pytest.raises(ValueError, match=r"data_parallel=2 x tensor_parallel=2 does not fit 2 processes"):
        Fabric(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(_identity, 2, 2))
    with pytest.raises(ValueError, match="data_parallel=auto x tensor_parallel=3 does not fit 4 processes"):
        lightning_mesh(1, "auto", 3).resolve(4)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=0 is not valid.*positive int or 'auto'"):
        ModelParallelStrategy(_identity, tensor_parallel_size=0)


def test_the_registry_name_asks_for_a_parallelize_fn() -> None:
    with pytest.raises(ValueError, match=r"needs parallelize_fn.*ModelParallelStrategy\(parallelize_fn=...\)"):
        Fabric(accelerator="cpu", devices=2, strategy="model_parallel")
