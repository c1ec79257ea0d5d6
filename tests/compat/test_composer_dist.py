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
from fabric.trainer.devices import DeviceCPU, DeviceGPU, get_device

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


@pytest.mark.parametrize("first", ["trainer", "initialize_dist"])
def test_a_composer_program_on_two_processes_gets_composers_answers(tmp_path: Path, first: str) -> None:
    """The group comes from the Trainer, or from ``initialize_dist(get_device(None))`` first (llm-foundry's
    ``train.py``), which the Trainer then adopts and trains in."""
    environment = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    command = [sys.executable, "-m", "fabric_cli", "run", "model", "--drop-in=composer", "-n", "2",
               "--accelerator=cpu", PROGRAM, str(tmp_path), first]  # fmt: skip
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
        assert report["trained_batches"] == 1
        if first == "initialize_dist":
            assert report["initialized_by_program"] == [True, 2, "gloo"]
            assert report["trainer_adopted_the_group"] is True
    assert sorted(reports[0]["sampler"] + reports[1]["sampler"]) == list(range(10))
    first_seed, same_seed, other_seed = (reports[0]["shuffled"][i] + reports[1]["shuffled"][i] for i in range(3))
    assert sorted(first_seed) == list(range(10)) and first_seed == same_seed and other_seed != first_seed
    assert reports[0]["signal_name"] == reports[1]["signal_name"]  # rank 0's name on every rank
    assert reports[0]["signal_written"] is True and (tmp_path / reports[0]["signal_name"]).exists()


@pytest.mark.usefixtures("one_process")
def test_initialize_dist_in_one_process_makes_a_group_of_one_as_composer_does() -> None:
    try:
        dist.initialize_dist(get_device(None), timeout=30)
        assert torch.distributed.get_world_size() == 1 and torch.distributed.get_backend() == "gloo"
        assert [os.environ[name] for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK")] == ["1", "0", "0"]
        tensor = torch.tensor([2.0])
        dist.all_reduce(tensor)
        assert tensor.item() == 2.0
        dist.initialize_dist("cpu")  # joined already, same backend: nothing to do
        with pytest.raises(RuntimeError, match=r"initialised with 'gloo', not 'nccl'"):
            dist.initialize_dist("gpu")
    finally:
        torch.distributed.destroy_process_group()
        for name in (*LAUNCHER_VARIABLES, "LOCAL_WORLD_SIZE"):
            os.environ.pop(name, None)


@pytest.mark.usefixtures("one_process")
def test_initialize_dist_in_a_larger_world_names_the_missing_launcher_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2 but MASTER_ADDR, MASTER_PORT not set"):
        dist.initialize_dist("cpu")
    assert not dist.is_initialized()


def test_get_device_answers_composers_device_objects() -> None:
    device = get_device(None)  # no CUDA here: the CPU, as Composer picks
    assert isinstance(device, DeviceCPU) and (device.name, device.dist_backend) == ("cpu", "gloo")
    assert get_device(device) is device and isinstance(get_device("cpu"), DeviceCPU)
    gpu = DeviceGPU(1)
    assert (gpu.name, gpu.dist_backend, gpu._device) == ("gpu", "nccl", torch.device("cuda", 1))
    batch = {"x": torch.ones(2, dtype=torch.float64), "y": [torch.zeros(1)]}
    moved = device.batch_to_device(batch)
    assert moved["x"].device.type == "cpu" and moved["y"][0].device.type == "cpu"
    with pytest.raises(ValueError, match=r"get_device\('tpu'\): the device is one of \['cpu', 'gpu', 'mps'\]"):
        get_device("tpu")
