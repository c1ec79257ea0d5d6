"""DDP really running in several CPU processes over gloo, launched every way a user launches it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fabric import Fabric
from fabric.plugins.environments import find_free_port

SCRIPTS = Path(__file__).parents[1] / "scripts"


def _run(args: list[str], timeout: float = 120, **kwargs: object) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, **kwargs)  # type: ignore[call-overload]


def _results(out_dir: Path, world_size: int) -> list[dict]:
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=True) for rank in range(world_size)]


@pytest.fixture(scope="module")
def single_process_reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out_dir = tmp_path_factory.mktemp("reference")
    result = _run([sys.executable, str(SCRIPTS / "ddp_train.py"), str(out_dir), "single_device", "1"])
    assert result.returncode == 0, result.stderr
    return _results(out_dir, 1)[0]


def _assert_matches_reference(ranks: list[dict], reference: dict) -> None:
    first = ranks[0]["params"]
    for other in ranks[1:]:
        for a, b in zip(first, other["params"], strict=True):
            assert torch.equal(a, b), "parameters differ across ranks"
    for a, b in zip(first, reference["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert ranks[0]["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]


def test_script_launch_trains_like_one_process_on_the_full_batch(
    tmp_path: Path, single_process_reference: dict
) -> None:
    result = _run([sys.executable, str(SCRIPTS / "ddp_train.py"), str(tmp_path)])
    assert result.returncode == 0, result.stderr
    ranks = _results(tmp_path, 2)
    assert [r["world_size"] for r in ranks] == [2, 2]
    _assert_matches_reference(ranks, single_process_reference)
    # The sampler gave each rank a disjoint half of the data, every epoch.
    per_epoch = [set(r["seen"][:32]) for r in ranks]
    assert not per_epoch[0] & per_epoch[1] and per_epoch[0] | per_epoch[1] == set(range(64))


def test_the_same_script_under_torchrun_gives_the_same_result(tmp_path: Path, single_process_reference: dict) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={find_free_port()}"]
    result = _run([*command, str(SCRIPTS / "ddp_train.py"), str(tmp_path)])
    assert result.returncode == 0, result.stderr
    _assert_matches_reference(_results(tmp_path, 2), single_process_reference)


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork"])
def test_launch_function_returns_rank_zeros_result_with_tensors(strategy: str) -> None:
    result = _run([sys.executable, str(SCRIPTS / "spawn_return.py"), strategy])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "rank=0 world=2 total=21.0 type=Tensor"


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork"])
def test_launch_without_a_function_under_spawn_or_fork_fails_at_once_naming_launch_fn(strategy: str) -> None:
    """The processes run only launch()'s function; without one the script went on in the parent alone and crashed
    with "Default process group has not been initialized"."""
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2)
    with pytest.raises(TypeError, match=r"needs a function here.*Call fabric\.launch\(train\)"):
        fabric.launch()
    assert not fabric.launched


def test_launch_function_returns_a_result_larger_than_a_pipe_holds() -> None:
    result = _run([sys.executable, str(SCRIPTS / "spawn_return.py"), "ddp_spawn", "large"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "shape=(4, 1024, 1024) values=[10.0]"


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork"])
def test_a_launched_rank_raising_stops_the_others_and_reraises_its_traceback(strategy: str) -> None:
    """Rank 0 sleeps for 10 minutes; the job ends once rank 1 raises, with rank 1's traceback."""
    start = time.monotonic()
    result = _run([sys.executable, str(SCRIPTS / "spawn_return.py"), strategy, "rank1_raises"], timeout=120)
    assert result.returncode == 1
    assert "RankFailedError: Rank 1 of the launched job failed." in result.stderr
    assert "ValueError: rank 1 fails on purpose" in result.stderr
    assert time.monotonic() - start < 60, "rank 0 must be stopped, not waited for"


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_return_the_documented_shapes_and_values(tmp_path: Path, world_size: int) -> None:
    result = _run([sys.executable, str(SCRIPTS / "ddp_collectives.py"), str(tmp_path), str(world_size)])
    assert result.returncode == 0, result.stderr
    for rank, got in enumerate(_results(tmp_path, world_size)):
        assert got["gather"].shape == (world_size, 2, 3)
        assert got["gather"][:, 0, 0].tolist() == list(range(world_size))
        assert got["gather_collection"]["a"].tolist() == list(range(world_size))
        assert got["gather_collection"]["b"][0].shape == (world_size, 1)
        assert [t.tolist() for t in got["gather_uneven"]] == [list(range(r + 1)) for r in range(world_size)]
        assert got["sum"].item() == sum(range(1, world_size + 1))
        assert got["int_mean"].dtype == torch.float32
        assert got["int_mean"].item() == pytest.approx(sum(range(world_size)) / world_size)
        assert got["max"].tolist() == [world_size - 1, 0]
        assert got["min"].item() == 10
        assert got["broadcast"]["from"] == world_size - 1
        # Every rank's loss is the sum of all gathered values, so each input's gradient is summed over ranks.
        assert got["sync_grads"].tolist() == [(rank + 1.0) * world_size] * 2, "gradients flow back through all_gather"
        assert got["grad_unsynced"].tolist() == [[rank + 1.0] * 3]
        mean_of_ranks = sum(range(1, world_size + 1)) / world_size
        assert got["grad_synced"].tolist() == [[pytest.approx(2 * mean_of_ranks)] * 3]  # accumulated, averaged
        assert got["loaded_from"] == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by a dead parent's init) no longer runs.
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text()


def _pids(pid_dir: Path) -> list[int]:
    return [int(path.read_text()) for path in sorted(pid_dir.glob("rank*.pid"))]


@pytest.mark.end_to_end  # a whole 2-rank job failing on purpose: scripts/test.sh --end-to-end
@pytest.mark.parametrize(
    ("mode", "expected_code", "message"),
    [
        ("child_raises", 1, "local rank 1 (pid"),
        ("child_exits_3", 3, "exited with code 3"),
        # rank 0 loses rank 1 mid-collective before rank 1's process has ended: the job exited 1 in 19 of 20 runs,
        # blaming rank 0's collectives as "probably called on some ranks only"
        ("child_exits_3_in_loop", 3, "local rank 1 (pid"),
        ("rank0_raises", 1, "rank 0 fails on purpose"),
    ],
)
def test_a_failing_rank_ends_the_whole_job_with_its_code(
    tmp_path: Path, mode: str, expected_code: int, message: str
) -> None:
    start = time.monotonic()
    result = _run([sys.executable, str(SCRIPTS / "ddp_failures.py"), mode, str(tmp_path)], timeout=60)
    elapsed = time.monotonic() - start
    assert result.returncode == expected_code, result.stderr
    assert message in result.stderr
    assert "probably called on some ranks only" not in result.stderr, "a peer's death is not a mismatch"
    if mode == "child_exits_3_in_loop":
        assert "exited with code 3; rank 0 failed after it" in result.stderr
        assert "another rank's process ended while this rank waited for it" in result.stderr
    # under the 60 s collective timeout: the job stopped, rank 0 did not wait it out (30 s is ample beside load)
    assert elapsed < 45, "the job should stop soon after the failure, not run until the surviving ranks finish"
    assert len(_pids(tmp_path)) == 2
    assert not any(_alive(pid) for pid in _pids(tmp_path)), "a rank was left running"


@pytest.mark.end_to_end  # a whole 2-rank job failing on purpose: scripts/test.sh --end-to-end
@pytest.mark.parametrize(
    ("mode", "code", "message"),
    [
        ("rank0_exits_7", 7, "rank 0 exited with code 7"),
        # a DDP model keeps rank 0's connections open until its process ends: rank 1 waited 5 minutes in backward
        ("rank0_exits_7_training", 7, "rank 0 exited with code 7"),
        # exit handlers cannot see the code of a bare SystemExit: the job still ends promptly and not with success
        ("rank0_raises_systemexit_7", 1, "local rank 1 (pid"),
    ],
)
def test_rank_zero_exiting_early_ends_the_job_promptly_with_its_code(
    tmp_path: Path, mode: str, code: int, message: str
) -> None:
    """Rank 0 leaves while rank 1 waits for it in a collective with a 5-minute timeout."""
    start = time.monotonic()
    result = _run([sys.executable, str(SCRIPTS / "ddp_failures.py"), mode, str(tmp_path)], timeout=120)
    assert result.returncode == code, result.stderr
    assert message in result.stderr and result.stderr.count("stopping the job") == 1, result.stderr
    assert time.monotonic() - start < 100, "rank 1 must not wait out the 5-minute collective timeout"
    assert not any(_alive(pid) for pid in _pids(tmp_path)), "a rank was left running"


@pytest.mark.end_to_end  # a whole 2-rank job failing on purpose: scripts/test.sh --end-to-end
def test_a_sys_exit_that_rank_zero_catches_neither_stops_the_others_nor_fails_the_job(tmp_path: Path) -> None:
    result = _run([sys.executable, str(SCRIPTS / "ddp_failures.py"), "rank0_catches_exit", str(tmp_path)])
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "rank1.done").read_text() == "done"  # rank 1 was waited for, not stopped
    assert "stopping the job" not in result.stderr


@pytest.mark.end_to_end  # a whole 2-rank job failing on purpose: scripts/test.sh --end-to-end
def test_sys_exit_is_the_interpreters_own_again_once_the_job_is_torn_down(tmp_path: Path) -> None:
    """Rank 0's launcher replaces ``sys.exit`` to hear rank 0's exit code while it watches the other ranks, and gives
    it back at the job's end: exit handlers that run after Fabric's get Python's own."""
    result = _run([sys.executable, str(SCRIPTS / "sys_exit_scope.py"), str(tmp_path)])
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "rank0.txt").read_text() == "replaced during the job: True, own again: True"
    assert (tmp_path / "rank1.txt").read_text() == "replaced during the job: False, own again: True"


@pytest.mark.end_to_end  # a whole 2-rank job failing on purpose: scripts/test.sh --end-to-end
def test_a_barrier_reached_by_one_rank_only_fails_naming_the_missing_rank(tmp_path: Path) -> None:
    result = _run([sys.executable, str(SCRIPTS / "ddp_failures.py"), "only_rank0_barrier", str(tmp_path)], timeout=90)
    assert result.returncode != 0
    assert "barrier 'only rank 0'" in result.stderr
    assert "1" in result.stderr.split("barrier 'only rank 0'")[1][:400]
    assert not any(_alive(pid) for pid in _pids(tmp_path))


def test_sigterm_to_rank_zero_stops_the_children(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "ddp_failures.py"), "wait", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while len(_pids(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # polling for the ranks to come up, not timing anything
    assert len(_pids(tmp_path)) == 2
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    deadline = time.monotonic() + 15
    while any(_alive(pid) for pid in _pids(tmp_path)[1:]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in _pids(tmp_path)), "the child outlived a killed rank 0"
