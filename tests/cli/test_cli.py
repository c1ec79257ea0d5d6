"""The ``fabric run model`` CLI: option parsing, every bad input, and real 2-rank launches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from fabric.plugins.environments import find_free_port

SCRIPTS = Path(__file__).parents[1] / "scripts"
REPORT = str(SCRIPTS / "cli_report.py")
FABRIC = [sys.executable, "-m", "fabric_cli"]


def _clean_env() -> dict[str, str]:
    launcher_variables = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")
    return {key: value for key, value in os.environ.items() if key not in launcher_variables}


def _fabric(*args: str, timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``fabric ...`` run to its end; by default in a new temporary directory, where its ``runs/`` folder goes."""
    return subprocess.run(
        [*FABRIC, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_clean_env(),
        cwd=cwd or tempfile.mkdtemp(prefix="fabric-cli-"),
        check=False,
    )


def _reports(out_dir: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(out_dir.glob("rank*.json"))]


def test_help_and_version_answer_without_importing_torch() -> None:
    code = (
        "import sys\nfrom fabric_cli.cli import main\nsys.argv = ['fabric', 'run', 'model', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip().endswith("False")
    assert "--precision [32-true|64-true|16-mixed|bf16-mixed|fp8-mixed|16-true|bf16-true" in result.stdout
    assert _fabric("--version").stdout.strip() == "fabric, version 0.1.0"


@pytest.mark.parametrize(("args", "usage"), [([], "fabric [OPTIONS] COMMAND"), (["run"], "fabric run [OPTIONS]")])
def test_fabric_alone_prints_its_help_not_an_error(args: list[str], usage: str) -> None:
    result = _fabric(*args)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.startswith(f"Usage: {usage}") and "Commands:" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategy", "magic", REPORT], "'magic' is not one of 'auto', 'single_device', 'ddp'"),
        (["--precision", "17", REPORT], "'17' is not one of '32-true'"),
        (["--accelerator", "tpu", REPORT], "'tpu' is not one of 'auto', 'gpu', 'cuda', 'mps', 'cpu'"),
        (["--devices", "two", REPORT], "devices='two' is not valid. Accepted: an int >= 1"),
        (["--accelerator", "cpu", "--devices", "0,1", REPORT], "on CPU pass a process count"),
        (["--accelerator", "cuda", "--devices", "2", REPORT], "accelerator='cuda' is not available"),
        (["--num-nodes", "2", "--node-rank", "2", "--main-address", "h", REPORT], "--node-rank=2 is outside [0, 2)"),
        (["--num-nodes", "2", REPORT], "--num-nodes=2 needs --main-address"),
        (["missing_script.py"], "SCRIPT 'missing_script.py' is not a file"),
        (["--main-port", "70000", REPORT], "70000 is not in the range 1<=x<=65535"),
        (["--strategy", "single_device", "--devices", "2", REPORT],
         "--strategy=single_device runs one process, but the job has 2 (2 on this node)"),  # ranks crashed after 2-19 s
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_code_2(args: list[str], message: str) -> None:
    result = _fabric("run", "model", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("options", "what"),
    [
        (["--run-dir", "{blocker}/run"],
         "cannot create the run directory (--run-dir) '{blocker}/run': Not a directory"),
        (["--stderr", "{blocker}/e{{rank}}.log"],
         "cannot create the folder of rank 1's stderr (--stderr) '{blocker}': File exists"),
    ],
)  # fmt: skip
def test_an_unwritable_run_directory_or_log_is_one_line_and_exit_2_before_any_rank_starts(
    tmp_path: Path, options: list[str], what: str
) -> None:
    """It was a 26-line traceback and exit 1, sometimes after rank 0 had started."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    options = [option.format(blocker=blocker) for option in options]
    result = _fabric("run", "model", "--devices", "2", *options, REPORT, str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith(f"fabric: error: {what.format(blocker=blocker)}"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not list(tmp_path.glob("rank*.json"))  # no rank started


def test_a_rank_that_exits_mid_collective_is_reported_as_the_cause_not_the_rank_that_lost_it(tmp_path: Path) -> None:
    """Rank 1 sys.exit(3) while rank 0 waits for it in an all_reduce: rank 0 fails first (its connection closed)
    and the job ended with "rank 0 exited with code 1" in 7 of 13 runs."""
    script = str(SCRIPTS / "ddp_failures.py")
    result = _fabric("run", "model", "--devices", "2", "--run-dir", str(tmp_path / "run"), script,
                     "child_exits_3_in_loop", str(tmp_path / "pids"))  # fmt: skip
    assert result.returncode == 3, result.stderr
    assert "fabric: rank 1 exited with code 3" in result.stderr
    assert "probably called on some ranks only" not in result.stderr


def test_a_rank_that_only_lost_its_peer_says_so_in_one_line_and_the_summary_comes_last(tmp_path: Path) -> None:
    """Rank 0, waiting in a barrier for rank 1 that exited, printed a 28-line traceback ending in gloo's "Ranks 1 failed
    to pass monitoredBarrier in 1800000 ms" (the job did not wait 30 minutes: that is the timeout, quoted)."""
    script = str(SCRIPTS / "ddp_failures.py")
    result = _fabric("run", "model", "--devices", "2", "--run-dir", str(tmp_path / "run"), script,
                     "child_exits_3_at_barrier", str(tmp_path / "pids"), cwd=tmp_path)  # fmt: skip
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    fabric_lines = [line.split("]: ", 1)[-1] for line in result.stderr.splitlines() if "fabric: " in line]
    assert fabric_lines[0].startswith(
        f"fabric: Rank 0 failed in barrier 'after work', called at {script}:"
    ) and fabric_lines[0].endswith(": another rank's process ended while this rank waited for it. That rank's own "
        "failure (an exception, sys.exit, a signal such as the out-of-memory killer's SIGKILL) is the cause; the "
        "launcher reports it."), fabric_lines  # fmt: skip
    # the summary, naming the cause, is the last thing on screen (rank 1 printed nothing: no tail of its log follows)
    lines = result.stderr.splitlines()
    summary = f"fabric: rank 1 exited with code 3; log: {tmp_path / 'run' / 'rank1' / 'stderr.log'}"
    assert lines[lines.index(summary) :] in ([summary], [summary, "fabric: rank 0 failed after it."]), lines


@pytest.mark.end_to_end  # whole 2-rank jobs through the CLI: scripts/test.sh --end-to-end
def test_two_jobs_started_together_from_one_directory_keep_their_own_run_directories(tmp_path: Path) -> None:
    """Started in the same second, two jobs shared runs/<second>/ and one overwrote the other's rank logs."""
    out_dirs = [tmp_path / "out0", tmp_path / "out1"]
    jobs = []
    for out_dir in out_dirs:
        out_dir.mkdir()
        jobs.append(
            subprocess.Popen([*FABRIC, "run", "model", "--devices", "2", REPORT, str(out_dir)], env=_clean_env(),
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )  # fmt: skip
    for job in jobs:
        _, stderr = job.communicate(timeout=120)
        assert job.returncode == 0, stderr
    run_dirs = sorted((tmp_path / "runs").iterdir())
    assert len(run_dirs) == 2
    assert all((run_dir / "rank1" / "stdout.log").read_text() == "rank 1 reporting\n" for run_dir in run_dirs)


def test_dry_run_shows_the_plan_and_hands_on_only_the_options_given() -> None:
    result = _fabric("run", "model", "--devices", "2", "--dry-run", REPORT, "--", "--devices", "8")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"{REPORT} --devices 8" in out
    assert "world size:    2 (1 node(s))" in out
    assert "strategy:      (script decides)" in out
    assert "FABRIC_DEVICES=2" in out and "FABRIC_STRATEGY" not in out and "FABRIC_PRECISION" not in out
    assert "LOCAL_RANK=1" in out and "RANK=1" in out


def test_script_fabric_obeys_the_cli_and_script_args_pass_untouched(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = _fabric(
        "run", "model", "--accelerator", "cpu", "--devices", "2", "--precision", "bf16", "--run-dir", str(run_dir),
        REPORT, str(tmp_path), "--", "--devices", "4", "-x",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    reports = _reports(tmp_path)
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        assert report["world_size"] == 2 and report["strategy"] == "DDPStrategy"
        assert report["precision"] == "bf16-mixed" and report["sum"] == 3
        assert report["args"] == ["--devices", "4", "-x"]
    assert "rank 0 reporting" in result.stdout  # local rank 0 keeps the terminal
    assert (run_dir / "rank1" / "stdout.log").read_text() == "rank 1 reporting\n"


def test_module_mode_runs_python_dash_m(tmp_path: Path) -> None:
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(Path(REPORT).read_text())
    (tmp_path / "out").mkdir()
    result = _fabric("run", "model", "--devices", "2", "-m", "mypkg.train", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert [r["rank"] for r in _reports(tmp_path / "out")] == [0, 1]


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text()


def _children_of(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in children.read_text().split()] if children.exists() else []


def test_a_failing_rank_ends_the_job_with_its_code_and_its_log_tail(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    start = time.monotonic()
    result = _fabric(
        "run", "model", "--devices", "2", "--run-dir", str(run_dir),
        REPORT, str(tmp_path), "--fail-rank", "1", "--hang",
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert result.returncode == 7
    assert f"fabric: rank 1 exited with code 7; log: {run_dir / 'rank1' / 'stderr.log'}" in result.stderr
    assert "[rank 1] failing on purpose" in result.stderr
    assert elapsed < 30  # rank 0 was hanging; it was stopped instead of waited for
    assert not any(_alive(report["pid"]) for report in _reports(tmp_path)), "a rank was left running"


@pytest.mark.parametrize(("signum", "expected_code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_the_cli_stops_every_rank(tmp_path: Path, signum: int, expected_code: int) -> None:
    process = subprocess.Popen(
        [
            *FABRIC,
            "run",
            "model",
            "--devices",
            "2",
            "--run-dir",
            str(tmp_path / "run"),
            REPORT,
            str(tmp_path),
            "--hang",
        ],
        env=_clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("rank*.json"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # waiting for both ranks to come up
    ranks = _children_of(process.pid)
    assert len(ranks) == 2
    process.send_signal(signum)
    assert process.wait(timeout=30) == expected_code
    assert not any(_alive(pid) for pid in ranks)


def test_two_nodes_on_localhost(tmp_path: Path) -> None:
    port = str(find_free_port())
    common = ["--devices", "1", "--num-nodes", "2", "--main-address", "127.0.0.1", "--main-port", port]
    nodes = [
        subprocess.Popen(
            [*FABRIC, "run", "model", *common, "--node-rank", str(rank), REPORT, str(tmp_path)],
            env=_clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [node.communicate(timeout=120) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    reports = _reports(tmp_path)
    assert [(r["rank"], r["node_rank"], r["local_rank"], r["world_size"]) for r in reports] == [
        (0, 0, 0, 2),
        (1, 1, 0, 2),
    ]
    assert all(r["sum"] == 3 for r in reports)


def test_ddp_training_through_the_cli_matches_the_in_script_launch(tmp_path: Path) -> None:
    in_script = subprocess.run(
        [sys.executable, str(SCRIPTS / "ddp_train.py"), str(tmp_path / "a")], capture_output=True, env=_clean_env()
    )
    assert in_script.returncode == 0, in_script.stderr
    through_cli = _fabric(
        "run", "model", "--devices", "2", "--run-dir", str(tmp_path / "run"), str(SCRIPTS / "ddp_train.py"),
        str(tmp_path / "b"),
    )  # fmt: skip
    assert through_cli.returncode == 0, through_cli.stderr
    for rank in range(2):
        a = torch.load(tmp_path / "a" / f"rank{rank}.pt", weights_only=True)
        b = torch.load(tmp_path / "b" / f"rank{rank}.pt", weights_only=True)
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))


@pytest.mark.end_to_end  # whole 2-rank jobs through the CLI: scripts/test.sh --end-to-end
def test_devices_the_script_disagrees_with_fail_fast_instead_of_hanging(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    script = str(SCRIPTS / "ddp_train.py")
    result = _fabric("run", "model", "--run-dir", str(run_dir), script, str(tmp_path), "ddp", "2")
    assert result.returncode == 1
    assert "`fabric run` started 1 process, 1 on this node, but Fabric(devices=2, num_nodes=1)" in result.stderr
    conflicting = _fabric(
        "run", "model", "--devices", "2", "--run-dir", str(run_dir), script, str(tmp_path), "ddp", "3"
    )
    assert conflicting.returncode == 1
    assert "Fabric(devices=3) conflicts with the CLI's --devices=2 (FABRIC_DEVICES)" in conflicting.stderr


def test_nodes_without_a_node_count_leave_it_and_the_node_rank_to_the_join() -> None:
    common = ["run", "model", "--world_size", "3", "--base_rank", "2", "--main-address", "10.0.0.1"]
    result = _fabric(*common, "--dry-run", REPORT)
    assert result.returncode == 0, result.stderr
    assert (
        "world size:    3 (node count decided when the nodes join); this node: rank decided when the nodes join, "
        "global ranks 2..2"
    ) in result.stdout
    assert "NODE_RANK" not in result.stdout and "FABRIC_NUM_NODES" not in result.stdout  # both come with the join
    named = _fabric(*common, "--stdout", "node{node_rank}.log", "--devices", "2", "--base_rank", "1", REPORT)
    assert named.returncode == 2
    assert "uses {node_rank}, which is decided when the nodes join" in named.stderr


def test_uneven_nodes_take_world_size_and_base_rank() -> None:
    result = _fabric(
        "run", "model", "--devices", "3", "--num-nodes", "2", "--node-rank", "1", "--main-address", "10.0.0.1",
        "--world-size", "5", "--base-rank", "2", "--dry-run", REPORT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "world size:    5 (2 node(s)); this node: rank 1, global ranks 2..4" in result.stdout
    assert "main address:  10.0.0.1:29500" in result.stdout
    assert "LOCAL_RANK=2" in result.stdout and "RANK=4" in result.stdout and "WORLD_SIZE=5" in result.stdout
