"""The Lightning drop-in mode without Lightning installed (this environment): ``python -m fabric.compat.lightning``
runs a Lightning Fabric program unchanged, on 1 and 2 processes; every name of the table answers as it says; the
mode is never on by default; and docs/coming-from-lightning.md names every entry of the table."""

from __future__ import annotations

import csv
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from drop_in_checks import assert_answers, missing_from, served, table_entries

from fabric.compat.aliases import NotProvided, Refused
from fabric.compat.lightning_names import LIGHTNING_FABRIC

PROGRAM = str(Path(__file__).parent / "lightning_program.py")
ROOT = Path(__file__).parents[2]
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is not None, reason="these test the mode without Lightning installed"
)


def _run(*arguments: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    command = [sys.executable, *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment, check=False)


RUNNERS = {
    "runner": ["-m", "fabric.compat.lightning"],
    "cli": ["-m", "fabric_cli", "run", "model", "--drop-in=lightning"],
}


@pytest.mark.parametrize(("runner", "devices"), [("runner", 1), ("runner", 2), ("cli", 2)])
def test_a_lightning_fabric_program_runs_unchanged_through_the_drop_in_mode(
    tmp_path: Path, runner: str, devices: int
) -> None:
    """``python -m fabric.compat.lightning PROGRAM``, or ``fabric run model --drop-in=lightning --devices=2 PROGRAM``
    (the CLI starts the ranks; the program's ``launch()`` finds them started)."""
    cli_options = (
        ["--accelerator=cpu", f"--devices={devices}", f"--run-dir={tmp_path / 'run'}"] if runner == "cli" else []
    )
    job = _run(*RUNNERS[runner], *cli_options, PROGRAM, str(devices), str(tmp_path))
    assert job.returncode == 0, job.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(devices)]
    for report in reports:
        assert report["fabric_class"] == "fabric.fabric.Fabric" and report["world_size"] == devices
        assert report["quantized"] is False and len(report["losses"]) == 4 // devices
        assert report["losses"] == reports[0]["losses"]  # all-reduced: one value on every rank
    # The program never calls finalize: the rows still buffered are written at exit.
    with open(next(tmp_path.glob("fabric_logs/version_*/metrics.csv"))) as file:
        rows = list(csv.DictReader(file))
    assert [int(float(row["step"])) for row in rows] == list(range(4 // devices))
    assert [float(row["loss"]) for row in rows] == pytest.approx(reports[0]["losses"])


def test_without_the_runner_nothing_answers_for_lightning(tmp_path: Path) -> None:
    job = _run(PROGRAM, "1", str(tmp_path))
    assert job.returncode == 1 and "No module named 'lightning'" in job.stderr


def test_the_cli_refuses_a_drop_in_mode_for_a_command_or_one_it_does_not_have() -> None:
    command = _run(*RUNNERS["cli"], "-c", "ls")
    assert command.returncode == 2
    assert "--drop-in=lightning runs Python code, but -c/--command_mode runs SCRIPT as a command" in command.stderr
    unknown = _run("-m", "fabric_cli", "run", "model", "--drop-in=keras", PROGRAM)
    assert unknown.returncode == 2 and "'keras' is not one of 'composer', 'lightning'" in unknown.stderr


def test_the_runner_says_how_to_call_it() -> None:
    job = _run("-m", "fabric.compat.lightning")
    assert job.returncode == 2 and "usage: python -m fabric.compat.lightning (-m MODULE | SCRIPT)" in job.stderr


@pytest.fixture
def drop_in() -> Iterator[None]:
    with served(LIGHTNING_FABRIC, roots=("lightning",)):
        yield


@pytest.mark.usefixtures("drop_in")
@pytest.mark.parametrize(
    ("module", "name", "target"), table_entries(LIGHTNING_FABRIC), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_name_of_the_table_answers_with_ours_or_refuses_in_one_line(
    module: str, name: str, target: str | Refused
) -> None:
    assert_answers(module, name, target)


@pytest.mark.usefixtures("drop_in")
def test_a_modules_other_names_come_from_our_module_of_the_same_names() -> None:
    from fabric import strategies

    lightning_strategies = importlib.import_module("lightning.fabric.strategies")
    for name in strategies.__all__:
        assert getattr(lightning_strategies, name) is getattr(strategies, name)
    with pytest.raises(NotProvided, match=r"lightning\.fabric\.strategies\.nothing has no counterpart in torch-fabric"):
        exec("from lightning.fabric.strategies import nothing")
    with pytest.raises(NotProvided, match=r"lightning\.pytorch is not provided by torch-fabric: it is Lightning's"):
        importlib.import_module("lightning.pytorch")
    with pytest.raises(NotProvided, match=r"lightning\.fabric\.xla has no counterpart"):
        importlib.import_module("lightning.fabric.xla")


def test_the_migration_doc_names_every_entry_of_the_table() -> None:
    """The table is the migration doc made executable: each mapped or refused name, and each module, is in the doc."""
    assert missing_from(LIGHTNING_FABRIC, (ROOT / "docs" / "coming-from-lightning.md").read_text()) == []
