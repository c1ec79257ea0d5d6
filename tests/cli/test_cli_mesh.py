"""``fabric run model --mesh``: checked against the world before anything starts; the script's strategy builds it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from test_cli_options import SCRIPTS, _dry_run, _fabric

from fabric import Fabric
from fabric.strategies import FSDPStrategy, MeshPlan, ModelParallelStrategy
from fabric.utilities.cli_contract import CLI_MARKER, CLI_MESH

REPORT = str(SCRIPTS / "mesh_report.py")


def test_the_mesh_reaches_the_scripts_fabric_which_shards_over_it(tmp_path: Path) -> None:
    mesh = "data_parallel_replicate=2"
    result = _fabric(
        "run", "--accelerator=cpu", "--devices=4", "--strategy=fsdp", f"--mesh={mesh}", REPORT, str(tmp_path)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    for rank, report in enumerate(reports):
        assert report["strategy"] == "FSDPStrategy"
        assert report["mesh"] == "data_parallel_replicate=2,data_parallel=2"
        assert report["placements"] == ["R", "S(0)"]  # HSDP: 2 replicas of a 2-way shard
        assert report["local_rows"] == 4
        assert report["data_parallel_shard"] == [4, rank]


def test_the_mesh_cuts_a_scripts_pipeline_and_shares_its_data_training_as_one_process(tmp_path: Path) -> None:
    """``--mesh=pipeline_parallel=2,data_parallel=2`` with a script that names only the cut: 2 stages, each on 2 data
    shares, train as one process on the whole batches would (losses and weights)."""
    mesh = "pipeline_parallel=2,data_parallel=2"
    result = _fabric(
        "run", "--accelerator=cpu", "--devices=4", f"--mesh={mesh}", str(SCRIPTS / "cli_pipeline_job.py"), str(tmp_path)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    sys.path.insert(0, str(SCRIPTS))
    try:
        from pipeline_job_reference import STEPS, batches, make_model
    finally:
        sys.path.pop(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for inputs, targets in batches()[:STEPS]:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    reports = [torch.load(tmp_path / f"rank-{rank}.pt") for rank in range(4)]
    assert sorted(tuple(report["data_parallel_shard"]) for report in reports) == [(2, 0), (2, 0), (2, 1), (2, 1)]
    expected = model.state_dict()
    for report in reports:
        assert report["mesh"] == mesh
        assert report["losses"] == pytest.approx(losses, rel=1e-5)
        for name, value in report["weights"].items():  # its stage's
            torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=2e-6)
    assert {name for report in reports for name in report["weights"]} == set(expected), "every stage held"


def test_the_dry_run_shows_the_mesh_and_a_mesh_that_does_not_fit_is_one_line() -> None:
    assert "mesh:          data_parallel=2,tensor_parallel=2" in _dry_run(
        "run", "--accelerator=cpu", "--devices=4", "--mesh", "data_parallel=2, tensor_parallel=2", REPORT
    )
    result = _fabric("run", "--accelerator=cpu", "--devices=4", "--mesh=tensor_parallel=3", REPORT, "--dry-run")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "fabric: error: --mesh=tensor_parallel=3: The mesh data_parallel=auto x tensor_parallel=3 does not fit 4 "
        "processes: the degrees' product must equal the world size (the auto one is what the others leave)."
    )


def _cli(mesh: str) -> dict[str, str]:
    return {CLI_MARKER: "1", CLI_MESH: mesh}


def _build(strategy: object, environ: dict[str, str]) -> Fabric:
    from fabric.connector import resolve

    return resolve(accelerator="cpu", strategy=strategy, devices=4, environ=environ)  # type: ignore[arg-type]


def test_a_strategy_without_a_mesh_and_a_conflicting_one_refuse_the_clis_mesh() -> None:
    with pytest.raises(
        ValueError, match=r"--mesh=data_parallel_replicate=2 \(FABRIC_MESH\) shapes the device mesh .* DDPStrategy"
    ):
        _build("ddp", _cli("data_parallel_replicate=2"))
    with pytest.raises(
        ValueError, match=r"FSDPStrategy\(mesh=data_parallel_replicate=4\) conflicts with the CLI's --mesh"
    ):
        _build(FSDPStrategy(mesh=MeshPlan(data_parallel_replicate=4)), _cli("data_parallel_replicate=2"))
    with pytest.raises(ValueError, match=r"tensor_parallel=2 needs ModelParallelStrategy\(parallelize_fn, mesh=...\)"):
        _build("fsdp", _cli("tensor_parallel=2"))
    with pytest.raises(
        ValueError, match=r"ModelParallelStrategy\(data_parallel_size=2, tensor_parallel_size=2\) conflicts"
    ):
        _build(ModelParallelStrategy(lambda model, mesh: model, 2, 2), _cli("tensor_parallel=2"))


def test_the_clis_mesh_is_taken_by_mesh_strategies_and_ignored_outside_cli_processes() -> None:
    same = FSDPStrategy(mesh=MeshPlan(data_parallel_replicate=2))
    assert _build(same, _cli("data_parallel_replicate=2")).strategy.mesh_plan().data_parallel == 2  # type: ignore[attr-defined]
    model_parallel = _build(ModelParallelStrategy(lambda model, mesh: model), _cli("tensor_parallel=4")).strategy
    assert model_parallel.mesh_plan().as_text() == "data_parallel=1,tensor_parallel=4"  # type: ignore[attr-defined]
    stale = _build("fsdp", {CLI_MESH: "data_parallel_replicate=2"}).strategy  # a variable left in a shell
    assert stale.mesh_plan().as_text() == "data_parallel=4"  # type: ignore[attr-defined]
