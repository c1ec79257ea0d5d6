"""The exit code a job ends with (fabric.utilities.exit_codes), row by row, and the scope of the launcher's sys.exit.

The real jobs behind each row are in tests/strategies/test_ddp.py, tests/cli/test_cli.py, tests/cli/test_cli_signals.py
and tests/utilities/processes/test_job_processes.py; here the decision alone, without processes.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NoReturn

import pytest

from fabric.strategies.launchers.subprocess_script import ChildSupervisor
from fabric.utilities.exit_codes import RankExit, failure_cause, job_exit_code


def ended(rank: int, returncode: int, lost_a_peer: bool = False) -> RankExit:
    return RankExit(rank, returncode, lost_a_peer=lost_a_peer)


def train_py_rank_zero(returncode: int, lost_a_peer: bool = False) -> RankExit:
    """Rank 0 of ``python train.py``, the launcher's own process."""
    return RankExit(0, returncode, lost_a_peer=lost_a_peer, is_launcher=True)


@dataclass(frozen=True)
class Row:
    situation: str
    #: In the order the ranks ended.
    exits: tuple[RankExit, ...]
    code: int
    #: The rank whose failure the job reports (None: no rank failed).
    cause: int | None = None
    stop_signal: int | None = None
    killed: bool = False


ROWS = [
    Row("every rank ends with 0", (ended(1, 0), ended(0, 0)), 0),
    Row("every rank was preempted", (ended(1, 75), ended(0, 75)), 75),
    Row("one rank was preempted, the others ended with 0", (ended(0, 0), ended(1, 75)), 75),
    Row("a rank raises", (ended(1, 1), ended(0, 1, lost_a_peer=True)), 1, cause=1),
    Row("a rank calls sys.exit(3)", (ended(1, 3), ended(0, 0)), 3, cause=1),
    Row("the OOM killer's SIGKILL", (ended(1, -signal.SIGKILL),), 137, cause=1),
    Row("a rank killed by SIGSEGV", (ended(0, 0), ended(1, -signal.SIGSEGV)), 139, cause=1),
    Row("a rank fails after another was preempted", (ended(0, 75), ended(1, 1)), 1, cause=1),
    Row(
        "the first to fail only lost a peer, whose own failure shows after it",
        (ended(0, 1, lost_a_peer=True), ended(1, 3)),
        3,
        cause=1,
    ),
    Row(
        "every failed rank only lost a peer",
        (ended(2, 1, lost_a_peer=True), ended(0, 6, lost_a_peer=True)),
        1,
        cause=2,
    ),
    Row(
        "rank 0 of train.py leaves with sys.exit(7), a child fails after it",
        (train_py_rank_zero(7), ended(1, 1)),
        7,
        cause=0,
    ),
    Row("rank 0 of train.py leaves with sys.exit(75): it is the launcher", (train_py_rank_zero(75),), 75, cause=0),
    Row("rank 0 of train.py ends well, a child fails after it", (train_py_rank_zero(0), ended(1, 1)), 1, cause=1),
    Row(
        "rank 0 of train.py fails only because its child's process ended",
        (train_py_rank_zero(1, lost_a_peer=True), ended(1, 3)),
        3,
        cause=1,
    ),
    Row("SIGTERM: every rank saved", (ended(1, 75), ended(0, 75)), 75, stop_signal=signal.SIGTERM),
    Row("SIGTERM: every rank ended with 0", (ended(0, 0), ended(1, 0)), 0, stop_signal=signal.SIGTERM),
    Row(
        "SIGTERM: the first non-zero code in rank order, not in exit order",
        (ended(1, -signal.SIGTERM), ended(0, 75)),
        75,
        stop_signal=signal.SIGTERM,
    ),
    Row("SIGTERM: a plain script's ranks die of it", (ended(0, -signal.SIGTERM),), 143, stop_signal=signal.SIGTERM),
    Row("SIGTERM: a rank had to be killed", (ended(0, 75), ended(1, -9)), 143, stop_signal=signal.SIGTERM, killed=True),
    Row("SIGTERM before any rank started", (), 143, stop_signal=signal.SIGTERM),
    Row("SIGINT", (ended(0, 75), ended(1, 0)), 130, stop_signal=signal.SIGINT),
    Row("a second signal while the ranks were given time", (), 130, stop_signal=signal.SIGINT, killed=True),
]


@pytest.mark.parametrize("row", ROWS, ids=[row.situation for row in ROWS])
def test_the_job_ends_with_the_code_of_its_row(row: Row) -> None:
    assert job_exit_code(row.exits, stop_signal=row.stop_signal, killed=row.killed) == row.code
    if row.stop_signal is None:
        cause = failure_cause(row.exits)
        assert (cause.rank if cause else None) == row.cause


@pytest.fixture
def supervisor_factory(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], ChildSupervisor]]:
    """Supervisors of one child that ends at once, as ``launch()`` makes them in rank 0; ``sys.exit`` is put back
    after the test, whatever it did."""
    monkeypatch.setattr(sys, "exit", sys.exit)
    monkeypatch.delattr(sys, "last_value", raising=False)  # a failed test before this one leaves pytest's error here
    started: list[ChildSupervisor] = []

    def supervisor() -> ChildSupervisor:
        started.append(ChildSupervisor({1: subprocess.Popen([sys.executable, "-c", "pass"])}))
        return started[-1]

    yield supervisor
    for each in started:
        each.close()


def test_sys_exit_is_replaced_while_rank_zero_is_watched_and_given_back_when_it_ends(
    supervisor_factory: Callable[[], ChildSupervisor],
) -> None:
    interpreters_exit = sys.exit
    supervisor = supervisor_factory()
    assert sys.exit is not interpreters_exit
    with pytest.raises(SystemExit) as caught:
        sys.exit(3)  # still exits with its code; being caught, it is not rank 0's exit
    assert caught.value.code == 3
    supervisor._at_rank_zero_exit()  # what rank 0's process runs at its end
    assert sys.exit is interpreters_exit


@pytest.mark.parametrize("first_to_end", [0, 1])
def test_two_supervisors_in_one_process_replace_sys_exit_once_and_give_back_the_original(
    supervisor_factory: Callable[[], ChildSupervisor], first_to_end: int
) -> None:
    interpreters_exit = sys.exit
    supervisors = [supervisor_factory()]
    replaced_by = sys.exit
    supervisors.append(supervisor_factory())
    assert sys.exit is replaced_by, "one replacement, not one per supervisor"
    supervisors[first_to_end]._at_rank_zero_exit()
    assert sys.exit is replaced_by, "the other supervisor still listens for rank 0's exit"
    supervisors[1 - first_to_end]._at_rank_zero_exit()
    assert sys.exit is interpreters_exit


def test_a_sys_exit_replaced_after_the_launcher_stays_when_the_job_ends(
    supervisor_factory: Callable[[], ChildSupervisor],
) -> None:
    supervisor = supervisor_factory()

    def replaced_later(status: object = None) -> NoReturn:
        raise SystemExit(status)

    sys.exit = replaced_later
    supervisor._at_rank_zero_exit()
    assert sys.exit is replaced_later
