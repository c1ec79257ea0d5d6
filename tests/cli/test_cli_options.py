"""``fabric run`` command lines as the seed documents write them: Lightning's options after SCRIPT,
Composer's launcher flags and environment defaults, impossible layouts and busy ports refused early."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fabric_cli.arguments import OptionNames, split_arguments
from fabric_cli.cli import run_model
from fabric_cli.layout import Layout, LayoutError, resolve_layout

SCRIPTS = Path(__file__).parents[1] / "scripts"
REPORT = str(SCRIPTS / "cli_report.py")
FABRIC = [sys.executable, "-m", "fabric_cli"]
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "BASE_RANK")


def _env(**extra: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if k not in (*LAUNCH_VARIABLES, "MASTER_ADDR", "MASTER_PORT")}
    return {**environ, **extra}


def _fabric(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*FABRIC, *args], capture_output=True, text=True, env=env or _env(), timeout=timeout, check=False
    )


def _dry_run(*args: str, env: dict[str, str] | None = None) -> str:
    result = _fabric(*args, "--dry-run", env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _split(*args: str) -> tuple[list[str], list[str]]:
    import click

    with click.Context(run_model) as ctx:
        return split_arguments(OptionNames.of(run_model.get_params(ctx)), args)


@pytest.mark.parametrize(
    ("args", "own", "script_args"),
    [
        # Lightning's documented form: every option after SCRIPT is the CLI's own
        (["t.py", "--strategy=ddp", "--devices=8", "--precision", "bf16"],
         ["t.py", "--strategy=ddp", "--devices=8", "--precision", "bf16"], []),
        # unknown options, short options and plain words after SCRIPT go to the script, in order
        (["-n", "2", "t.py", "--lr", "0.1", "data", "-x", "-n3"],
         ["-n", "2", "t.py"], ["--lr", "0.1", "data", "-x", "-n3"]),
        # the script's own -v, -n 2, -c config.yaml and -m stay the script's; the CLI's long forms are the CLI's
        (["t.py", "-v", "-n", "2", "-c", "config.yaml", "-m", "--verbose", "--nproc", "2"],
         ["t.py", "--verbose", "--nproc", "2"], ["-v", "-n", "2", "-c", "config.yaml", "-m"]),
        # everything after -- is the script's, even the CLI's own option names
        (["t.py", "--devices", "2", "--", "--devices", "8", "--"],
         ["t.py", "--devices", "2"], ["--devices", "8", "--"]),
        # before SCRIPT a cluster of known flags is the CLI's; after it every short option is the script's
        (["-vm", "t.py", "-vm", "-vq"], ["-vm", "t.py"], ["-vm", "-vq"]),
        # a negative number is a value, never an option
        (["--devices", "-1", "t.py", "-1"], ["--devices", "-1", "t.py"], ["-1"]),
        # -- before SCRIPT: the next word is SCRIPT
        (["-v", "--", "t.py", "--devices", "2"], ["-v", "t.py"], ["--devices", "2"]),
    ],
)  # fmt: skip
def test_arguments_split_into_the_clis_and_the_scripts(args: list[str], own: list[str], script_args: list[str]) -> None:
    assert _split(*args) == (own, script_args)


@pytest.mark.parametrize(
    ("args", "first", "again"),
    [
        (["--devices=2", "t.py", "--devices", "4"], "--devices=2", "--devices 4"),
        (["-n", "2", "t.py", "--nproc=4"], None, None),  # -n is not a long option: its meaning before SCRIPT is sure
        (["--verbose", "t.py", "--verbose"], "--verbose", "--verbose"),
        (["--num-nodes", "1", "t.py", "--num_nodes", "2"], "--num-nodes", "--num_nodes 2"),
    ],
)
def test_a_long_option_before_and_after_script_is_an_error_naming_both_meanings(
    args: list[str], first: str | None, again: str | None
) -> None:
    import click

    if first is None:
        assert _split(*args) == (args, [])  # the later value wins, as click's does
        return
    with pytest.raises(click.UsageError) as error:
        _split(*args)
    message = error.value.message
    assert f"given before SCRIPT ({first}" in message and f"again after t.py ({again})" in message
    assert "a second value for fabric run model or t.py's own" in message
    assert f"fabric run model {first} t.py -- {again}" in message


def test_short_options_after_script_reach_the_script_and_start_the_processes_asked_for(tmp_path: Path) -> None:
    """Before, ``-n 2`` after SCRIPT started two processes and ``-v`` vanished from the script's arguments."""
    result = _fabric("run", "model", "--accelerator=cpu", "--devices=1", REPORT, str(tmp_path), "-v", "-n", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    reports = sorted(tmp_path.glob("*.json"))
    assert len(reports) == 1, reports
    report = json.loads(reports[0].read_text())
    assert report["args"] == ["-v", "-n", "2"] and report["world_size"] == 1


def test_the_seed_examples_configure_the_cli_and_the_short_form_is_the_same() -> None:
    seed_form = [
        "./" + os.path.relpath(REPORT),
        "--strategy=ddp",
        "--devices=2",
        "--accelerator=cpu",
        "--precision=bf16",
    ]
    for command in (["run", "model"], ["run"]):
        out = _dry_run(*command, *seed_form, "--unknown", "value")
        assert "strategy:      ddp" in out and "devices:       2" in out and "precision:     bf16" in out
        assert "accelerator:   cpu" in out and "world size:    2 (1 node(s))" in out
        assert out.splitlines()[0].endswith("cli_report.py --unknown value")  # the rest went to the script


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bogus", REPORT], "No such option '--bogus'"),
        (["-n", "2", "--master_prot", "29511", REPORT], "No such option '--master_prot'"),
        (["-m", "-c", REPORT], "-m/--module_mode and -c/--command_mode exclude each other"),
        (["-c", "no-such-command-here"], "SCRIPT 'no-such-command-here' is not an executable command"),
        (["-n", "3", "--stdout", "out.log", REPORT], "--stdout gives ranks 1 and 2 the same file 'out.log'"),
        (
            ["--stderr", "{rank}-{host}.log", REPORT],
            "--stderr='{rank}-{host}.log' uses {host}; accepted fields: {rank}",
        ),
        (["--term-timeout", "-1", REPORT], "-1.0 is not in the range x>=0"),
    ],
)
def test_bad_composer_style_input_is_one_line_naming_it(args: list[str], message: str) -> None:
    result = _fabric("run", "model", *args)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_composer_flags_and_environment_defaults_set_the_layout() -> None:
    out = _dry_run(
        "run", "model", "-n", "2", "--world_size", "4", "--node_rank", "1", "--master_addr", "198.18.0.1",
        "--master_port", "29511", "--run_directory", "job", "-m", "pkg.train",
    )  # fmt: skip
    assert "world size:    4 (2 node(s)); this node: rank 1, global ranks 2..3" in out
    assert "main address:  198.18.0.1:29511" in out and "-m pkg.train" in out
    assert f"FABRIC_RUN_DIRECTORY={Path('job').absolute()}" in out and "FABRIC_NUM_NODES=2" in out
    environment = _env(
        WORLD_SIZE="5", LOCAL_WORLD_SIZE="3", BASE_RANK="2", MASTER_ADDR="198.18.0.1", MASTER_PORT="29512"
    )
    out = _dry_run("run", "model", "--num-nodes", "2", REPORT, env=environment)
    assert "world size:    5 (2 node(s)); this node: rank 1, global ranks 2..4" in out
    assert "main address:  198.18.0.1:29512" in out and "LOCAL_WORLD_SIZE=3" in out
    bad = _fabric("run", "model", "--dry-run", REPORT, env=_env(WORLD_SIZE="two"))
    assert bad.returncode == 2 and "'two' is not a valid integer" in bad.stderr and "(from $WORLD_SIZE)" in bad.stderr


def test_composers_world_size_minus_one_means_devices_times_nodes_and_zero_is_refused() -> None:
    """``--world_size -1`` is Composer's documented default; it was refused as out of range."""
    out = _dry_run("run", "model", "-n", "2", "--world_size", "-1", "--accelerator", "cpu", REPORT)
    assert "world size:    2 (1 node(s)); this node: rank 0, global ranks 0..1" in out
    bad = _fabric("run", "model", "--dry-run", "--world_size", "0", REPORT)
    assert bad.returncode == 2 and "0 is not valid. Accepted: a number of processes >= 1, or -1" in bad.stderr


def test_script_arguments_get_home_and_variables_expanded_as_composers_launcher_does() -> None:
    environment = _env(HOME="/home/user", DATA_ROOT="/datasets")
    out = _dry_run(
        "run", "model", "--accelerator", "cpu", REPORT, "~/data", "$DATA_ROOT/train", "$NOT_SET", env=environment
    )
    assert f"{REPORT} /home/user/data /datasets/train '$NOT_SET'" in out  # an unset variable stays as written


def test_command_mode_and_output_templates_really_run(tmp_path: Path) -> None:
    """``-c`` runs an executable itself; rank 1's output goes where ``--stdout``/``--stderr`` say; the ranks
    see the run directory and unbuffered Python."""
    script = tmp_path / "job.sh"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{REPORT}" "$@"\n')
    script.chmod(0o755)
    result = _fabric(
        "run", "-c", "-n", "2", str(script), str(tmp_path), "--keep", "--verbose",
        "--run_directory", str(tmp_path / "run"),
        "--stdout", "{run_dir}/out-{rank}-of-{world_size}.log", "--stderr", "{run_dir}/out-{rank}-of-{world_size}.log",
        env=_env(PYTHONUNBUFFERED=""),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [r["sum"] for r in reports] == [3, 3] and reports[1]["args"] == ["--keep"]
    assert reports[1]["env"]["FABRIC_RUN_DIRECTORY"] == str(tmp_path / "run")
    assert reports[1]["env"]["PYTHONUNBUFFERED"] == ""  # the user's setting wins
    assert "rank 1 reporting" in (tmp_path / "run" / "out-1-of-2.log").read_text()
    assert "rank 0 reporting" in result.stdout
    assert "fabric: node 0 of 1 starts ranks 0..1 of 2 (rendezvous 127.0.0.1:" in result.stderr  # -v
    assert "fabric: rank 1 exited with code 0" in result.stderr


@pytest.mark.parametrize(
    ("processes", "given", "expected"),
    [
        (2, {}, Layout(2, 2, 1, 0, 0)),
        (2, {"world_size": 4, "node_rank": 1}, Layout(2, 4, 2, 1, 2)),
        # Composer's form names no node count: nodes may differ in size, so count and node rank are decided at join
        (2, {"world_size": 4, "base_rank": 2}, Layout(2, 4, None, None, 2)),
        (2, {"world_size": 3}, Layout(2, 3, None, 0, 0)),
        (1, {"world_size": 3, "base_rank": 2}, Layout(1, 3, None, None, 2)),
        (3, {"world_size": 5, "num_nodes": 2, "node_rank": 1}, Layout(3, 5, 2, 1, 2)),  # the last node: 5 - 3
        (1, {"world_size": 4, "num_nodes": 3, "node_rank": 1, "base_rank": 2}, Layout(1, 4, 3, 1, 2)),
        (2, {"num_nodes": 3, "node_rank": 2}, Layout(2, 6, 3, 2, 4)),
    ],
)
def test_layouts_that_add_up_are_completed(processes: int, given: dict[str, int], expected: Layout) -> None:
    assert resolve_layout(processes, **given) == expected


@pytest.mark.parametrize(
    ("processes", "given", "message"),
    [
        (2, {"world_size": 3, "num_nodes": 1}, "--world-size=3 does not match the 2 processes of a single node"),
        (2, {"world_size": 1}, "--world-size=1 is smaller than the 2 processes"),
        (2, {"base_rank": 5}, "--base-rank=5 puts this node's 2 processes at ranks 5..6, outside the world of 2"),
        (2, {"world_size": 3, "num_nodes": 3}, "--world-size=3 is too small for 3 nodes"),
        (2, {"world_size": 5, "node_rank": 0}, "--world-size=5 is not a multiple of the 2 processes"),
        (2, {"world_size": 5, "base_rank": 4}, "--base-rank=4 puts this node's 2 processes at ranks 4..5, outside"),
        (2, {"world_size": 4, "num_nodes": 2, "node_rank": 0, "base_rank": 2}, "node 0 runs rank 0"),
        (2, {"world_size": 5, "num_nodes": 2, "node_rank": 1, "base_rank": 2}, "leaves ranks 4..4 of --world-size=5"),
        (2, {"world_size": 7, "num_nodes": 3, "node_rank": 1}, "node 1's first rank is unknown: pass --base-rank"),
        (2, {"num_nodes": 2, "node_rank": 2}, "--node-rank=2 is outside [0, 2)"),
        (1, {"world_size": 3, "num_nodes": 3, "node_rank": 1, "base_rank": 2}, "fewer than one rank each"),
    ],
)
def test_layouts_that_cannot_add_up_are_refused(processes: int, given: dict[str, int], message: str) -> None:
    with pytest.raises(LayoutError, match=None) as error:
        resolve_layout(processes, **given)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "args",
    [
        ["--world-size", "3", "--devices", "2", REPORT],
        ["--base-rank", "5", "--devices", "2", REPORT],
        ["--num-nodes", "2", REPORT],  # no --main-address; the device count is never needed
        ["--bogus", REPORT],
        ["--stdout", "{nope}", REPORT],
        ["--mesh", "replicate=2", REPORT],
        ["--accelerator", "cpu", "--devices", "4", "--mesh", "tensor_parallel=3", REPORT],
    ],
)
def test_bad_input_answers_without_importing_torch(args: list[str]) -> None:
    code = (
        "import sys\nfrom fabric_cli.cli import main\n"
        f"sys.argv = ['fabric', 'run', 'model', *{args!r}]\n"
        "try:\n    main()\nexcept SystemExit as done:\n    print(done.code, 'torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), check=True)
    assert result.stdout.split() == ["2", "False"], result.stderr
    assert result.stderr.startswith("fabric: error: ")


def test_a_busy_main_port_is_one_line_naming_it_and_the_option() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for args, env in ((["--master_port", str(port)], None), ([], _env(MASTER_PORT=str(port)))):
            result = _fabric("run", "model", "--devices", "2", *args, REPORT, env=env)
            assert result.returncode == 2
            assert (
                result.stderr == f"fabric: error: port {port} is already in use on this machine: pick a free one "
                "with --main-port.\n"
            )


def test_the_cli_warns_of_oversubscribed_cpu_processes_before_starting_them_as_fabric_does() -> None:
    """Fabric(devices=64) warned on a 2-core machine; `fabric run model --devices=64` started 64 processes silently."""
    cores = os.cpu_count() or 1
    many, fine = 4 * cores + 1, 4 * cores
    result = _fabric("run", "model", "--accelerator=cpu", f"--devices={many}", "--dry-run", REPORT)
    assert result.returncode == 0, result.stderr
    assert result.stderr == (
        f"fabric: warning: --devices={many} starts {many} CPU processes on this node, which has {cores} cores "
        f"({many / cores:.0f} per core): each gets a sliver of a core and its own copy of the model, and the job may "
        f"exhaust memory or take ages to start. Did you mean --devices={cores} (or --devices=-1)?\n"
    )
    assert _fabric("run", "model", "--accelerator=cpu", f"--devices={fine}", "--dry-run", REPORT).stderr == ""
    with pytest.warns(UserWarning, match=rf"^devices={many} starts {many} CPU processes on this node"):
        from fabric import Fabric

        Fabric(accelerator="cpu", devices=many)
