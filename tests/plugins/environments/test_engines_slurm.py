"""Fabric under a real SLURM cluster (one node, its own namespace): ``srun`` steps join one world, an ``sbatch``
script without ``srun`` and ``salloc`` self-launch, contradicting arguments fail on every task, and a job that
``scancel --signal=TERM`` preempts saves, exits 75, and resumes bit-exact when submitted again."""

from __future__ import annotations

import time
from pathlib import Path

import engines
import pytest
import torch
from engines import SlurmCluster
from worlds import WORLD, assert_one_world_trained, reports

from fabric.trainer.checkpoint.preemption import PREEMPTED_EXIT_CODE

#: Slow: a real SLURM cluster started by the test (`bash scripts/test.sh --end-to-end`; CI runs it).
pytestmark = pytest.mark.end_to_end

slurm_cluster = engines.slurm_cluster
PREEMPTIBLE = str(Path(__file__).parents[2] / "scripts" / "trainer_preemptible.py")


def test_srun_tasks_with_a_default_fabric_train_as_one_world(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """Both tasks of `srun -n 2` with a default Fabric() became SingleDeviceStrategy, world 1, rank 0, and each
    trained on all the data, silently."""
    result = slurm_cluster.run(["srun", "-n", "2", "python", WORLD, str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = reports(tmp_path, 2)
    assert_one_world_trained(ranks, 2)
    assert {r["environment"] for r in ranks} == {"SLURMEnvironment"}
    assert [(r["local_rank"], r["node_rank"]) for r in ranks] == [(0, 0), (1, 0)]


def test_srun_tasks_with_contradicting_devices_fail_on_every_task_naming_both(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """`srun -n 2` with Fabric(devices=1): rank 1 died with a bare IndexError in parallel_devices[local_rank]."""
    result = slurm_cluster.run(["srun", "-n", "2", "python", WORLD, str(tmp_path), "devices=1"])
    assert result.returncode == 1
    expected = "SLURM's srun started 2 processes, 2 on this node, but Fabric(devices=1, num_nodes=1)"
    assert result.stderr.count(expected) == 2, result.stderr[-3000:]
    assert "IndexError" not in result.stderr
    single = slurm_cluster.run(["srun", "-n", "2", "python", WORLD, str(tmp_path), "strategy=single_device"])
    assert single.returncode == 1
    assert single.stderr.count("strategy='single_device' runs one process") == 2, single.stderr[-3000:]
    assert not list(tmp_path.glob("rank*.json"))


def _batch_script(tmp_path: Path, *lines: str) -> Path:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --output=" + str(tmp_path / "job.out") + "\n")
    with script.open("a") as file:
        file.write("\n".join(lines) + "\n")
    return script


def test_an_sbatch_script_without_srun_launches_the_ranks_itself(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The batch shell's variables (SLURM_NTASKS=2, no SLURM_STEP_ID) were taken for a 2-task step, and the job
    waited silently for 30 minutes for a rank 1 nobody started."""
    script = _batch_script(tmp_path, f"python {WORLD} {tmp_path} devices=2")
    assert slurm_cluster.batch([str(script)]) == 0, (tmp_path / "job.out").read_text()[-3000:]
    ranks = reports(tmp_path, 2)
    assert_one_world_trained(ranks, 2)
    assert {r["environment"] for r in ranks} == {"LocalEnvironment"}


def test_an_sbatch_script_with_srun_trains_one_world(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = _batch_script(tmp_path, f"srun python {WORLD} {tmp_path}")
    assert slurm_cluster.batch([str(script)]) == 0, (tmp_path / "job.out").read_text()[-3000:]
    ranks = reports(tmp_path, 2)
    assert_one_world_trained(ranks, 2)
    assert {r["environment"] for r in ranks} == {"SLURMEnvironment"}


@pytest.mark.parametrize("step", [False, True], ids=["salloc-python", "salloc-srun"])
def test_salloc_runs_a_script_directly_or_through_srun(slurm_cluster: SlurmCluster, tmp_path: Path, step: bool) -> None:
    command = ["srun", "python", WORLD, str(tmp_path)] if step else ["python", WORLD, str(tmp_path), "devices=2"]
    result = slurm_cluster.run(["salloc", "-n", "2", *command], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = reports(tmp_path, 2)
    assert_one_world_trained(ranks, 2)
    assert {r["environment"] for r in ranks} == {"SLURMEnvironment" if step else "LocalEnvironment"}


def _final_parameters(out_dir: Path) -> list[list[torch.Tensor]]:
    return [torch.load(out_dir / f"final-rank{rank}.pt", weights_only=True) for rank in range(2)]


def test_scancel_preempts_a_trainer_with_workers_that_saves_exits_75_and_resumes_bit_exact(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    full, preempted = tmp_path / "full", tmp_path / "preempted"
    full.mkdir()
    preempted.mkdir()
    uninterrupted = slurm_cluster.run(["srun", "-n", "2", "python", PREEMPTIBLE, str(full), "0"])
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]

    # with DataLoader workers: scancel's SIGTERM reaches them too, and they used to die of it before the save
    job = slurm_cluster.popen(
        ["srun", "-n", "2", "--job-name=preempt-me", "python", PREEMPTIBLE, str(preempted), "4", "2"]
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(preempted.glob("waiting-rank*"))) < 2:  # both tasks are at batch 4, in fit()
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.1)
        cancel = slurm_cluster.run(["scancel", "--signal=TERM", "--name=preempt-me"], timeout=30)
        assert cancel.returncode == 0, cancel.stderr
        _, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == PREEMPTED_EXIT_CODE, stderr[-3000:]
    assert not list(preempted.glob("final-rank*"))

    resumed = slurm_cluster.run(["srun", "-n", "2", "python", PREEMPTIBLE, str(preempted), "0"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "rank 0/2 starts at batch 4" in resumed.stdout and "rank 1/2 starts at batch 4" in resumed.stdout
    for expected, got in zip(_final_parameters(full), _final_parameters(preempted), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
