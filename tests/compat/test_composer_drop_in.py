"""The Composer drop-in mode (Composer does not install beside torch 2.13): ``python -m fabric.compat.composer`` and
``fabric run model --drop-in=composer`` run a Composer program unchanged, on 1 and 2 processes; every name of the table
answers as it says; the mode is never on by default; and docs/coming-from-composer.md names every entry."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from drop_in_checks import assert_answers, missing_from, served, table_entries

from fabric.compat.aliases import NotProvided, Refused
from fabric.compat.composer_names import COMPOSER

PROGRAM = str(Path(__file__).parent / "composer_program.py")
ROOT = Path(__file__).parents[2]
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def _run(*arguments: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    command = [sys.executable, *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment, check=False)


def _linear_with_warmup(batches: int, warmup: int = 2, peak: float = 0.5) -> list[float]:
    """Composer's LinearWithWarmupScheduler(t_warmup="2ba") on an lr of 0.5 over ``batches``, batch by batch."""
    return [peak * i / warmup if i < warmup else peak * (1 - (i - warmup) / (batches - warmup)) for i in range(batches)]


def test_a_composer_program_runs_unchanged_through_the_runner(tmp_path: Path) -> None:
    job = _run("-m", "fabric.compat.composer", PROGRAM, str(tmp_path))
    assert job.returncode == 0, job.stderr[-3000:]
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["trainer_class"] == "fabric.trainer.trainer.Trainer" and report["world_size"] == 1
    assert report["fit_end_is_an_event"] == "fit_end"
    assert report["learning_rates"] == pytest.approx(_linear_with_warmup(24))  # 12 batches, 2 epochs
    losses = report["losses"]
    assert len(losses) == 24 and sum(losses[-6:]) < sum(losses[:6])
    assert 0.0 <= report["eval_accuracy"] <= 1.0 and report["eval_accuracy"] * 32 == round(report["eval_accuracy"] * 32)


def test_a_composer_program_runs_on_two_processes_under_fabric_run_model(tmp_path: Path) -> None:
    """Composer's launcher flag ``-n 2``; each rank sees half of the batches and the same evaluation."""
    job = _run("-m", "fabric_cli", "run", "model", "--drop-in=composer", "-n", "2", "--accelerator=cpu",
               f"--run-dir={tmp_path / 'run'}", PROGRAM, str(tmp_path))  # fmt: skip
    assert job.returncode == 0, job.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for report in reports:
        assert report["world_size"] == 2
        assert report["learning_rates"] == pytest.approx(_linear_with_warmup(12))
    assert reports[0]["eval_accuracy"] == reports[1]["eval_accuracy"]


def test_without_the_runner_composer_is_not_there(tmp_path: Path) -> None:
    job = _run(PROGRAM, str(tmp_path))
    assert job.returncode == 1 and "No module named 'composer'" in job.stderr


@pytest.fixture
def drop_in() -> Iterator[None]:
    with served(COMPOSER, roots=("composer",)):
        yield


@pytest.mark.usefixtures("drop_in")
@pytest.mark.parametrize(
    ("module", "name", "target"), table_entries(COMPOSER), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_name_of_the_table_answers_with_ours_or_refuses_in_one_line(
    module: str, name: str, target: str | Refused
) -> None:
    assert_answers(module, name, target)


@pytest.mark.usefixtures("drop_in")
def test_a_modules_other_names_come_from_our_module_and_the_rest_are_refused_by_name() -> None:
    from fabric.trainer import algorithms, callbacks

    for ours, theirs in ((algorithms, "composer.algorithms"), (callbacks, "composer.callbacks")):
        module = importlib.import_module(theirs)
        for name in ours.__all__:
            assert getattr(module, name) is getattr(ours, name)
    with pytest.raises(NotProvided, match=r"composer\.algorithms\.Nothing has no counterpart in torch-fabric"):
        exec("from composer.algorithms import Nothing")
    from fabric.trainer import dist as our_dist

    namespace: dict[str, object] = {}
    exec("from composer.utils import dist", namespace)
    assert all(getattr(namespace["dist"], name) is getattr(our_dist, name) for name in our_dist.__all__)
    with pytest.raises(NotProvided, match=r"composer\.datasets has no counterpart"):
        importlib.import_module("composer.datasets")


def test_the_migration_doc_names_every_entry_of_the_table() -> None:
    """The table is the migration doc made executable: each mapped or refused name, and each module, is in the doc."""
    assert missing_from(COMPOSER, (ROOT / "docs" / "coming-from-composer.md").read_text()) == []
