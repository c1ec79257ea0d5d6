"""``composer.utils.dist`` (``fabric.trainer.dist``) with Composer's semantics: in one process without a group every
fact is the single-process one and every collective a no-op; a larger world without a group raises naming its size;
on two real processes (a Composer program under ``fabric run model --drop-in=composer -n 2``) each collective gives
what Composer's gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fabric.trainer import dist

PROGRAM = str(Path(__file__).parent / "composer_dist_program.py")
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in LAUNCHER_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    assert not dist.is_initialized()


@pytest.mark.usefixtures("one_process")
def test_in_one_process_the_facts_are_a_world_of_one_and_collectives_change_nothing() -> None:
    facts = [dist.get_world_size(), dist.get_global_rank(), dist.get_local_world_size(), dist.get_local_rank()]
    assert [*facts, dist.get_node_rank()] == [1, 0, 1, 0, 0]
    tensor = torch.tensor([3.0, 4.0])
    dist.all_reduce(tensor)
    dist.broadcast(tensor, src=0)
    dist.barrier()
    assert tensor.tolist() == [3.0, 4.0]
    assert [t.tolist() for t in dist.all_gather(tensor)] == [[3.0, 4.0]]
    assert dist.all_gather_object({"a": 1}) == [{"a": 1}]
    objects = ["x", 2]
    dist.broadcast_object_list(objects)
    assert objects == ["x", 2]
    assert list(dist.get_sampler(range(5))) == [0, 1, 2, 3, 4]
    with dist.run_local_rank_zero_first():
        ran = True
    assert ran


@pytest.mark.usefixtures("one_process")
def test_a_larger_world_without_a_process_group_raises_naming_its_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert (dist.get_world_size(), dist.get_global_rank()) == (2, 1)
    with pytest.raises(RuntimeError, match=r"barrier\(\) in a world of 2 processes, but torch\.distributed is not"):
        dist.barrier()
    with pytest.raises(RuntimeError, match=r"all_gather_object\(\) in a world of 2"):
        dist.all_gather_object(1)
    with pytest.raises(ValueError, match=r"reduce_operation='mean' is not one of \['SUM', 'PRODUCT'"):
        dist.all_reduce(torch.ones(1), reduce_operation="mean")


def test_a_composer_program_on_two_processes_gets_composers_answers(tmp_path: Path) -> None:
    environment = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    command = [sys.executable, "-m", "fabric_cli", "run", "model", "--drop-in=composer", "-n", "2",
               "--accelerator=cpu", PROGRAM, str(tmp_path)]  # fmt: skip
    job = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment, check=False)
    assert job.returncode == 0, job.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, report in enumerate(reports):
        assert report["before"] == [2, rank, rank, 2, 0, False]  # from the launcher's variables, before any group
        assert report["after"] == [2, rank, True]
        assert report["all_reduce"] == [3.0, 2]
        assert report["all_gather"] == [[0, 0], [1, 10]]
        assert report["all_gather_object"] == [{"rank": 0}, {"rank": 1}]
        assert report["broadcast_object_list"] == ["from rank 1", 1]
        assert report["broadcast"] == [1.0, 1.0]
        assert report["marker_seen_in_block"] is True  # local rank zero ran the block first
        assert report["download_seen"] == "data"
    assert sorted(reports[0]["sampler"] + reports[1]["sampler"]) == list(range(10))
