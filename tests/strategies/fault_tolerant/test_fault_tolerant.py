"""Fault tolerance without restarts (strategy="fault_tolerant_ddp", torchft): configurations that cannot work are
refused at construction or set-up in one line, and real replica groups, with a real lighthouse, survive a SIGKILLed
group, which rejoins with its peers' state.

The replica groups and the lighthouse run in a network namespace of their own: torchft's manager and its checkpoint
server listen on every interface of the namespace they run in.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from fabric.strategies.fault_tolerant.plan import EveryGroupHere, resolve_launch
from fabric.utilities.cli_contract import FT_LIGHTHOUSE, FT_REPLICA_GROUP, FT_REPLICA_GROUPS
from fabric.utilities.ports import find_free_port
from tests import engines
from tests.engines import (
    REPOSITORY,
    NetworkNamespace,
    SlurmCluster,
    launcher_environment,
    network_namespace,
    require_modules,
    require_namespaces,
    stop_process,
)

slurm_cluster = engines.slurm_cluster
WORKER = str(REPOSITORY / "tests" / "scripts" / "ft_replica_group.py")
TRAINER_WORKER = str(REPOSITORY / "tests" / "scripts" / "ft_trainer_group.py")
LIGHTHOUSE_PORT = 29510
#: Generous: a group's start-up (imports, process group, manager) takes seconds on a busy 2-core machine.
EVENT_DEADLINE = 240.0
#: How far ahead of the last reported step the stop is set: every group must read it before reaching it (the reports
#: lag the groups by the polling interval; a step takes tens of milliseconds).
STOP_MARGIN = 100
#: A restarted group joins the run within this many steps of being ready to train (its first quorum request): the
#: lighthouse admits it at its next quorum, a fraction of a second here where a step takes 10-30 ms (a wait for the
#: join timeout, 2 s, would be about a hundred).
JOIN_WITHIN_STEPS = 10


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({}, "replica_groups is not set: pass replica_groups=N"),
        ({"replica_groups": 0}, "replica_groups=0 is not valid. Accepted: an int >= 1."),
        (
            {"replica_groups": 2, "replica_group": 2},
            "replica_group=2 is not valid for replica_groups=2. Accepted: 0 to 1.",
        ),
        (
            {"replica_groups": 2, "replica_group": 0, "min_replica_groups": 3},
            "min_replica_groups=3 cannot be met by replica_groups=2: no step could ever commit",
        ),
        ({"replica_groups": 2, "replica_group": 0}, "No torchft lighthouse: pass lighthouse='host:port' or set"),
        (
            {"replica_groups": 2, "replica_group": 0, "lighthouse": "lighthouse.example"},
            "lighthouse='lighthouse.example' is not valid. Accepted: 'host:port'",
        ),
        (
            {"replica_groups": 1, "replica_group": 0, "lighthouse": "h:1", "timeout": timedelta(0)},
            "timeout=datetime.timedelta(0) is not valid",
        ),
    ],
)
def test_a_configuration_that_cannot_work_is_refused_naming_the_value(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        resolve_launch(**arguments, environment={})
    assert message in str(raised.value)


def test_without_its_group_index_a_process_starts_every_group_which_a_launched_rank_is_told_it_cannot() -> None:
    assert resolve_launch(replica_groups=2, environment={}) == EveryGroupHere(2, lighthouse=None)
    plan = resolve_launch(environment={FT_REPLICA_GROUPS: "3", FT_LIGHTHOUSE: "h:7"})
    assert plan == EveryGroupHere(3, lighthouse="http://h:7")  # the groups join the lighthouse given
    assert isinstance(plan, EveryGroupHere) and str(plan.unplaced_error()) == (
        "replica_group is not set: pass replica_group=I (0 to 2, this group's index) or set FABRIC_FT_REPLICA_GROUP; "
        "or start the lighthouse and all 3 groups on this machine with one command, `fabric run model "
        "--replica-groups=3 SCRIPT` (or `python SCRIPT`, which starts them at fabric.launch())."
    )


def test_the_launcher_variables_place_the_group_where_no_argument_does() -> None:
    environment = {FT_REPLICA_GROUP: "2", FT_REPLICA_GROUPS: "3", FT_LIGHTHOUSE: "10.0.0.5:29510"}
    plan = resolve_launch(environment=environment)
    assert (plan.replica_group, plan.replica_groups, plan.lighthouse) == (2, 3, "http://10.0.0.5:29510")
    assert plan.lighthouse_host_and_port == ("10.0.0.5", 29510)
    plan = resolve_launch(replica_group=0, replica_groups=2, lighthouse="http://h:7", environment={})
    assert (plan.replica_group, plan.replica_groups, plan.lighthouse) == (0, 2, "http://h:7")


def test_a_quorum_outwaits_an_exchange_that_only_its_timeout_ends() -> None:
    """A survivor can be inside an exchange with a group that died until ``timeout``; a quorum giving up sooner failed
    a healthy group (seen in CI: one survivor's recv waited 60 s, the other's quorum timed out at 60 s)."""
    plan = resolve_launch(replica_group=0, replica_groups=2, lighthouse="h:7", environment={})
    assert (plan.timeout, plan.quorum_timeout) == (timedelta(seconds=60), timedelta(seconds=120))
    plan = resolve_launch(
        replica_group=0, replica_groups=2, lighthouse="h:7", timeout=timedelta(seconds=5), environment={}
    )
    assert plan.quorum_timeout == timedelta(seconds=10)
    given = resolve_launch(
        replica_group=0, replica_groups=2, lighthouse="h:7", quorum_timeout=timedelta(seconds=3), environment={}
    )
    assert given.quorum_timeout == timedelta(seconds=3)


def test_without_torchft_the_strategy_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from fabric.strategies import FaultTolerantDDPStrategy

    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(ImportError, match=r"Fault tolerance needs the torchft package: pip install torchft"):
        FaultTolerantDDPStrategy(replica_group=0, replica_groups=1, lighthouse="127.0.0.1:1")


@pytest.mark.parametrize(
    ("name", "inside"), [("fault_tolerant_ddp", "DDPStrategy"), ("fault_tolerant_fsdp", "FSDPStrategy")]
)
def test_the_strategies_are_registry_names(name: str, inside: str) -> None:
    require_modules("fault tolerance", "torchft")
    from fabric import Fabric, strategies
    from fabric.strategies.fault_tolerant.strategy import FaultTolerantStrategy

    environment = {FT_REPLICA_GROUP: "1", FT_REPLICA_GROUPS: "2", FT_LIGHTHOUSE: "127.0.0.1:29510"}
    with _environment(environment):
        fabric = Fabric(accelerator="cpu", devices=2, strategy=name)
    strategy = fabric.strategy
    assert isinstance(strategy, FaultTolerantStrategy) and isinstance(strategy, getattr(strategies, inside))
    assert strategy.fault_tolerance.replica_group == 1
    # group 1 of 2, each of 2 ranks: the data is split in 4 shares, this rank's is the group's first; a group counts
    # its own samples
    assert (strategy.data_parallel_shard, strategy.batch_shares) == ((4, 2), 2)


def test_an_unreachable_lighthouse_fails_the_set_up_in_one_line(tmp_path: Path) -> None:
    require_modules("fault tolerance", "torchft")
    (tmp_path / "stop").write_text("3")
    port = find_free_port()  # nothing listens there
    result = subprocess.run(
        [sys.executable, WORKER, str(tmp_path), str(tmp_path / "stop")],
        env=launcher_environment(_group_variables(0, 1, f"127.0.0.1:{port}", find_free_port())),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    assert f"The torchft lighthouse at http://127.0.0.1:{port} is unreachable" in result.stderr
    assert not list(tmp_path.glob("*.jsonl"))  # not one step ran


def test_an_argument_and_a_launcher_variable_that_disagree_are_refused() -> None:
    environment = {FT_REPLICA_GROUP: "1", FT_REPLICA_GROUPS: "2", FT_LIGHTHOUSE: "http://h:1"}
    assert resolve_launch(replica_group=1, lighthouse="h:1", environment=environment).replica_group == 1
    with pytest.raises(ValueError, match=r"replica_group=0 conflicts with FABRIC_FT_REPLICA_GROUP=1 .* Remove one"):
        resolve_launch(replica_group=0, environment=environment)
    with pytest.raises(ValueError, match=r"lighthouse='h:2' conflicts with TORCHFT_LIGHTHOUSE=http://h:1"):
        resolve_launch(lighthouse="h:2", environment=environment)


def _dry_run(*options: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    (tmp_path / "train.py").write_text("")
    command = [sys.executable, "-m", "fabric_cli", "run", "model", "--dry-run", "--accelerator=cpu", *options]
    return subprocess.run(
        [*command, str(tmp_path / "train.py")],
        env=launcher_environment(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_fabric_run_model_makes_the_job_one_replica_group(tmp_path: Path) -> None:
    options = ("--devices=2", "--replica-groups=3", "--replica-group=1", "--lighthouse=10.1.1.1:29510")
    result = _dry_run(*options, tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "strategy:      fault_tolerant_ddp" in result.stdout
    for rank in range(2):
        line = next(line for line in result.stdout.splitlines() if line.startswith(f"local rank {rank}:  "))
        variables = dict(item.split("=", 1) for item in line.split(":  ", 1)[1].split())
        assert variables[FT_REPLICA_GROUP] == "1" and variables[FT_REPLICA_GROUPS] == "3"
        assert variables[FT_LIGHTHOUSE] == "http://10.1.1.1:29510"
        assert variables["FABRIC_STRATEGY"] == "fault_tolerant_ddp"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--replica-groups=3", "--replica-group=3", "--lighthouse=h:1"), "--replica-group=3 is not valid for "),
        (("--replica-groups=3", "--replica-group=1"), "No torchft lighthouse: pass --lighthouse=HOST:PORT"),
        (("--replica-group=1", "--lighthouse=h:1"), "--replica-groups is not set: pass --replica-groups=N"),
        (
            ("--replica-groups=2", "--replica-group=1", "--lighthouse=h:1", "--strategy=ddp"),
            "which needs --strategy=fault_tolerant_ddp or --strategy=fault_tolerant_fsdp; got --strategy=ddp",
        ),
    ],
)
def test_fabric_run_model_refuses_a_replica_group_that_cannot_work(
    options: tuple[str, ...], message: str, tmp_path: Path
) -> None:
    result = _dry_run(*options, tmp_path=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr.strip().splitlines()[-1]


def _group_plans(stdout: str) -> dict[int, dict[str, str]]:
    """Each group's local rank 0 variables from a ``--dry-run`` report of every group."""
    plans, group = {}, None
    for line in stdout.splitlines():
        if line.startswith("--- replica group "):
            group = int(line.split()[3])
        elif line.startswith("local rank 0:  ") and group is not None:
            plans[group] = dict(item.split("=", 1) for item in line.split(":  ", 1)[1].split())
    return plans


def test_fabric_run_model_plans_every_group_on_this_machine_with_a_lighthouse(tmp_path: Path) -> None:
    result = _dry_run("--devices=2", "--replica-groups=3", f"--run-dir={tmp_path / 'run'}", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    bind = result.stdout.splitlines()[0].removeprefix("lighthouse:    started on ")
    assert bind.startswith("127.0.0.1:")
    plans = _group_plans(result.stdout)
    assert sorted(plans) == [0, 1, 2]
    for group, variables in plans.items():
        assert variables[FT_REPLICA_GROUP] == str(group) and variables[FT_REPLICA_GROUPS] == "3"
        assert variables[FT_LIGHTHOUSE] == f"http://{bind}"
        assert variables["FABRIC_STRATEGY"] == "fault_tolerant_ddp"
        assert variables["FABRIC_RUN_DIRECTORY"] == str(tmp_path / "run" / f"group{group}")
    ports = {variables["MASTER_PORT"] for variables in plans.values()}
    assert len(ports) == 3 and bind.rpartition(":")[2] not in ports  # a rendezvous of its own per group

    given = _dry_run("--replica-groups=2", "--lighthouse=10.1.1.1:29510", tmp_path=tmp_path)
    assert given.returncode == 0, given.stderr
    assert given.stdout.splitlines()[0] == "lighthouse:    http://10.1.1.1:29510"  # used, not started
    assert {v[FT_LIGHTHOUSE] for v in _group_plans(given.stdout).values()} == {"http://10.1.1.1:29510"}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--replica-groups=0",), "--replica-groups=0 is not valid. Accepted: an int >= 1."),
        (
            ("--replica-groups=2", "--strategy=ddp"),
            "which needs --strategy=fault_tolerant_ddp or --strategy=fault_tolerant_fsdp; got --strategy=ddp",
        ),
        (("--max-restarts=1",), "--max-restarts=1 restarts the replica groups this command starts, which needs"),
        (
            ("--replica-groups=2", "--replica-group=0", "--lighthouse=h:1", "--max-restarts=1"),
            "--max-restarts=1 restarts the replica groups this command starts, which needs --replica-groups=N without",
        ),
        (
            ("--replica-groups=2", "--num-nodes=2", "--node-rank=0", "--main-address=10.1.1.1"),
            "--replica-groups=2 without --replica-group starts every group on this machine, but the job spans several",
        ),
    ],
)
def test_fabric_run_model_refuses_groups_it_cannot_start_here(
    options: tuple[str, ...], message: str, tmp_path: Path
) -> None:
    result = _dry_run(*options, tmp_path=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr.strip().splitlines()[-1]


def test_fabric_lighthouse_refuses_a_bad_address() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fabric_cli", "lighthouse", "--bind", "nowhere"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "Invalid value for --bind: 'nowhere' is not HOST:PORT." in result.stderr


# --- real replica groups ---------------------------------------------------------------------------------------------


@dataclass
class Run:
    """A fault-tolerant run in a namespace: the lighthouse, the groups' processes and what they report."""

    namespace: NetworkNamespace
    directory: Path
    groups: int
    devices: int
    worker: str = WORKER
    #: The strategy ``fabric run model`` is given (groups of several processes).
    strategy: str = "fault_tolerant_ddp"
    processes: dict[int, subprocess.Popen[str]] = field(default_factory=dict)

    @property
    def stop_file(self) -> Path:
        return self.directory / "stop"

    def start_group(self, group: int, *options: str, torchrun_restarts: int | None = None) -> subprocess.Popen[str]:
        """Group ``group``: one process started directly, or with ``devices`` above 1 ``fabric run model``'s, or
        with ``torchrun_restarts`` torchrun's (``--max-restarts``, the group's variables in its environment);
        ``options`` go to the worker."""
        port, lighthouse = 29600 + group, f"127.0.0.1:{LIGHTHOUSE_PORT}"
        worker = [self.worker, str(self.directory), str(self.stop_file)]
        worker += [f"--devices={self.devices}", *options] if self.worker == WORKER else list(options)
        if torchrun_restarts is not None:
            command = [
                *(sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={self.devices}"),
                *(f"--max-restarts={torchrun_restarts}", "--monitor-interval=0.1", f"--master-port={port}", *worker),
            ]
            variables = _group_variables(group, self.groups, lighthouse, port)
        elif self.devices == 1:
            command, variables = [sys.executable, *worker], _group_variables(group, self.groups, lighthouse, port)
        else:
            command = [
                *(sys.executable, "-m", "fabric_cli", "run", "model", "--accelerator=cpu", f"--devices={self.devices}"),
                *(f"--replica-groups={self.groups}", f"--replica-group={group}", f"--lighthouse={lighthouse}"),
                f"--strategy={self.strategy}",
                *(f"--main-port={port}", f"--run-dir={self.directory / f'run{group}-{len(self.processes)}'}"),
                worker[0],
                "--",
                *worker[1:],
            ]
            variables = {"OMP_NUM_THREADS": "1"}
        log = (self.directory / f"group{group}-{len(self.processes)}.log").open("w")
        process = self.namespace.popen(
            command,
            env=launcher_environment(variables),
            cwd=self.directory,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.processes[group] = process
        return process

    def records(self) -> list[dict[str, Any]]:
        lines = [line for path in sorted(self.directory.glob("*.jsonl")) for line in path.read_text().splitlines()]
        return [json.loads(line) for line in lines if line.endswith("}")]

    def wait_for(self, what: str, condition: Callable[[list[dict[str, Any]]], bool]) -> list[dict[str, Any]]:
        """Poll the reports until ``condition`` holds; fail naming ``what`` (and the logs) past the deadline."""
        deadline = time.monotonic() + EVENT_DEADLINE
        while time.monotonic() < deadline:
            records = self.records()
            if condition(records):
                return records
            # A group the test stopped (SIGKILL, or SIGTERM: exit 75) is expected gone; any other exit ends the wait.
            dead = [group for group, process in self.processes.items() if process.poll() not in (None, -9, 75)]
            if dead:
                break
            time.sleep(0.2)
        logs = "\n".join(f"--- {path.name}\n{path.read_text()[-2000:]}" for path in self.directory.glob("*.log"))
        pytest.fail(f"never saw {what}\n{logs}")

    def stop_at(self, step: int) -> None:
        (self.directory / "stop.tmp").write_text(str(step))
        (self.directory / "stop.tmp").replace(self.stop_file)


def _group_variables(group: int, groups: int, lighthouse: str, port: int) -> dict[str, str]:
    return {
        FT_REPLICA_GROUP: str(group),
        FT_REPLICA_GROUPS: str(groups),
        FT_LIGHTHOUSE: lighthouse,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }


@contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def _fault_tolerant_run(
    directory: Path, groups: int, devices: int, worker: str = WORKER, strategy: str = "fault_tolerant_ddp"
) -> Iterator[Run]:
    require_modules("fault tolerance", "torchft")
    require_namespaces("fault tolerance")
    with network_namespace("ft", veth=False) as namespace:
        lighthouse = namespace.popen(
            [
                *(sys.executable, "-m", "fabric_cli", "lighthouse", f"--bind=127.0.0.1:{LIGHTHOUSE_PORT}"),
                *("--join-timeout-ms=2000", "--heartbeat-timeout-ms=2000"),
            ],
            env=launcher_environment(),
            cwd=directory,
        )
        run = Run(namespace, directory, groups, devices, worker, strategy)
        try:
            assert lighthouse.stdout is not None
            assert lighthouse.stdout.readline().strip() == f"{FT_LIGHTHOUSE}=http://127.0.0.1:{LIGHTHOUSE_PORT}"
            yield run
        finally:
            for process in run.processes.values():
                stop_process(process, grace=5.0)
            stop_process(lighthouse, grace=5.0)


def _by_group(records: list[dict[str, Any]], group: int, pid: int | None = None) -> list[dict[str, Any]]:
    return [r for r in records if r["group"] == group and (pid is None or r["pid"] == pid)]


def _committed(records: list[dict[str, Any]]) -> int:
    return max((r["committed_steps"] for r in records), default=0)


def _assert_joined_soon_after_ready(directory: Path, joined: dict[str, Any], peers: list[dict[str, Any]]) -> None:
    """``joined`` (a restarted group's first report) joined within a few steps of being set up and ready to train,
    counted in its ``peers``' committed steps then."""
    ready_file = next(directory.glob(f"ready-group{joined['group']}-rank{joined['rank']}-pid{joined['pid']}.json"))
    ready = json.loads(ready_file.read_text())["time"]
    steps_then = max(r["committed_steps"] for r in peers if r["time"] <= ready)
    assert joined["joined_at"] - steps_then <= JOIN_WITHIN_STEPS, (joined["joined_at"], steps_then)


@pytest.mark.end_to_end
def test_fsdp_shard_groups_built_apart_stop_at_the_first_step_saying_to_seed_them_alike(tmp_path: Path) -> None:
    """torchft syncs nothing at step 0 for shard groups (a rank would receive its shards from one group and its
    neighbour from another); groups that built the model apart would each train their own weights."""
    with _fault_tolerant_run(tmp_path, groups=2, devices=1) as run:
        processes = [run.start_group(group, "--strategy=fault_tolerant_fsdp") for group in range(2)]  # seeds 7, 8
        codes = [process.wait(timeout=EVENT_DEADLINE) for process in processes]
    assert all(code != 0 for code in codes), codes
    for group in range(2):
        log = (tmp_path / f"group{group}-{group}.log").read_text()
        assert f"Replica group {group} started with other weights than a peer group" in log, log[-2000:]
        assert "fabric.seed_everything(N)" in log
    assert not run.records()  # no step was taken


@pytest.mark.end_to_end
@pytest.mark.parametrize(
    ("devices", "strategy"),
    [(1, "fault_tolerant_ddp"), (2, "fault_tolerant_ddp"), (2, "fault_tolerant_fsdp")],
    ids=["groups_of_1", "ddp_groups_of_2_by_fabric_run_model", "fsdp_shard_groups_of_2_by_fabric_run_model"],
)
def test_a_killed_replica_group_does_not_stop_the_others_and_rejoins_with_their_state(
    tmp_path: Path, devices: int, strategy: str
) -> None:
    """FSDP2 shard groups: each rank's shards of the weights and optimizer state come from the same rank of a peer
    group; the groups are built alike (one seed), as they must be (torchft does not sync shards at step 0)."""
    options = [f"--strategy={strategy}"] + (["--seed=7"] if strategy == "fault_tolerant_fsdp" else [])
    with _fault_tolerant_run(tmp_path, groups=3, devices=devices, strategy=strategy) as run:
        first = {group: run.start_group(group, *options) for group in range(3)}
        records = run.wait_for(
            "all three groups training together",
            lambda rs: all(any(r["participants"] == 3 for r in _by_group(rs, g)) for g in range(3)),
        )
        killed = {r["pid"] for r in _by_group(records, 2)} | {first[2].pid}
        for pid in killed:  # the whole group, as when its node fails
            os.kill(pid, signal.SIGKILL)
        first[2].wait()
        killed_at = _committed(records)
        # the survivors carry on without it, in their own processes
        records = run.wait_for(
            "the two survivors committing 3 steps without group 2",
            lambda rs: all(
                sum(r["participants"] == 2 and r["committed_steps"] > killed_at for r in _by_group(rs, g)) >= 3
                for g in (0, 1)
            ),
        )
        run.start_group(2, *options)
        records = run.wait_for(
            "the restarted group 2 training with the others",
            lambda rs: any(
                r["pid"] not in killed and r["participants"] == 3 and r["joined_at"] is None for r in _by_group(rs, 2)
            ),
        )
        stop = _committed(records) + STOP_MARGIN
        run.stop_at(stop)
        for group, process in run.processes.items():
            assert process.wait(timeout=EVENT_DEADLINE) == 0, f"group {group} exited {process.returncode}"

    records = run.records()
    final = {}
    for group in range(3):
        for rank in range(devices):
            mine = [r for r in _by_group(records, group) if r["rank"] == rank and r["pid"] not in killed]
            steps = [r["committed_steps"] for r in mine]
            assert steps == sorted(steps)  # the step counter never went back
            final[group, rank] = (steps[-1], mine[-1]["weights"])
            if group == 2:
                joined = mine[0]
                assert joined["joined_at"] is not None and joined["joined_at"] > killed_at
                _assert_joined_soon_after_ready(tmp_path, joined, _by_group(records, 0))
                peers = [r for r in _by_group(records, 0) if r["committed_steps"] == joined["committed_steps"]]
                assert joined["weights"] == peers[0]["weights"]  # the peers' state, received at the join
                continue
            assert len({r["pid"] for r in mine}) == 1  # a survivor never restarted
            lost = sum(r["committed_steps"] == r["step"] for r in mine)  # a step that did not commit
            assert lost <= 1, f"group {group} rank {rank} lost {lost} steps"
    # every rank of every group trained to the same last step, to equal weights
    assert len(set(map(str, final.values()))) == 1, final
    assert next(iter(final.values()))[0] == stop
    joined_at = next(r["joined_at"] for r in _by_group(records, 2) if r["joined_at"] is not None)
    joined_line = f"fabric: replica group 2 joined the run at step {joined_at}"
    assert any(joined_line in path.read_text() for path in tmp_path.glob("group2-*.log"))
    # a survivor says when the groups taking part change, and which steps it discarded
    said = "".join(path.read_text() for path in tmp_path.glob("group0-*.log"))
    shrunk = re.findall(r"fabric: from step (\d+), 2 of 3 replica groups train; the data share of the 1 missing is not "
                        r"trained while they are away\.", said)  # fmt: skip
    regrown = re.findall(r"fabric: from step (\d+), 3 of 3 replica groups train\.", said)
    assert shrunk and killed_at <= int(shrunk[0]) < joined_at <= int(regrown[-1]), (shrunk, regrown, joined_at)
    for record in _by_group(records, 0):
        if record["committed_steps"] == record["step"]:  # not committed
            assert f"fabric: step {record['step']} was not committed" in said


@pytest.mark.end_to_end
def test_a_group_torchrun_restarts_alone_rejoins_with_the_others_state(tmp_path: Path) -> None:
    """The torchrun form (one ``torchrun --max-restarts`` per group): a killed worker is started again by its own
    torchrun only, joins the run within a few steps and takes the peers' state; the other group trains on in its
    process."""
    with _fault_tolerant_run(tmp_path, groups=2, devices=1) as run:
        run.start_group(0)
        agent = run.start_group(1, torchrun_restarts=1)
        records = run.wait_for(
            "both groups training together",
            lambda rs: all(any(r["participants"] == 2 for r in _by_group(rs, g)) for g in (0, 1)),
        )
        killed = _by_group(records, 1)[-1]["pid"]
        os.kill(killed, signal.SIGKILL)  # the worker, not its torchrun
        killed_at = _committed(records)
        records = run.wait_for(
            "group 1 restarted by its torchrun and training with group 0",
            lambda rs: any(r["pid"] != killed and r["participants"] == 2 for r in _by_group(rs, 1)),
        )
        stop = _committed(records) + STOP_MARGIN
        run.stop_at(stop)
        for group, process in run.processes.items():
            assert process.wait(timeout=EVENT_DEADLINE) == 0, f"group {group} exited {process.returncode}"
        assert agent.returncode == 0

    records = run.records()
    survivor = _by_group(records, 0)
    assert len({r["pid"] for r in survivor}) == 1  # never restarted
    assert sum(r["committed_steps"] == r["step"] for r in survivor) <= 1  # at most one step lost
    restarted = [r for r in _by_group(records, 1) if r["pid"] != killed]
    assert len({r["pid"] for r in restarted}) == 1  # one restart, by torchrun
    joined = restarted[0]
    # at the step it was killed at or later: torchrun can restart it before the survivor's quorum has let it go
    assert joined["joined_at"] is not None and joined["joined_at"] >= killed_at
    _assert_joined_soon_after_ready(tmp_path, joined, survivor)
    peer = next(r for r in survivor if r["committed_steps"] == joined["committed_steps"])
    assert joined["weights"] == peer["weights"]  # the peer's state, received at the join
    assert survivor[-1]["committed_steps"] == restarted[-1]["committed_steps"] == stop
    assert survivor[-1]["weights"] == restarted[-1]["weights"]


@pytest.mark.end_to_end
def test_one_fabric_run_model_starts_every_group_and_restarts_a_killed_one_that_takes_the_others_state(
    tmp_path: Path,
) -> None:
    require_modules("fault tolerance", "torchft")
    require_namespaces("fault tolerance")
    log_path = tmp_path / "cli.log"
    with network_namespace("ft", veth=False) as namespace, log_path.open("w") as log:
        command = [
            *(sys.executable, "-m", "fabric_cli", "run", "model", "--accelerator=cpu", "--devices=1"),
            *("--replica-groups=3", "--max-restarts=1", f"--run-dir={tmp_path / 'run'}", WORKER, "--"),
            *(str(tmp_path), str(tmp_path / "stop")),
        ]
        cli = namespace.popen(
            command,
            env=launcher_environment({"OMP_NUM_THREADS": "1"}),
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        run = Run(namespace, tmp_path, groups=3, devices=1, processes={0: cli})
        try:
            records = run.wait_for(
                "all three groups, started by one CLI, training together",
                lambda rs: all(any(r["participants"] == 3 for r in _by_group(rs, g)) for g in range(3)),
            )
            killed = {r["pid"] for r in _by_group(records, 2)}
            for pid in killed:  # the group's one process, as when its machine fails
                os.kill(pid, signal.SIGKILL)
            killed_at = _committed(records)
            records = run.wait_for(
                "group 2 restarted by the CLI, training with the others again",
                lambda rs: any(
                    r["pid"] not in killed and r["participants"] == 3 and r["joined_at"] is None
                    for r in _by_group(rs, 2)
                ),
            )
            stop = _committed(records) + STOP_MARGIN
            run.stop_at(stop)
            assert cli.wait(timeout=EVENT_DEADLINE) == 0, log_path.read_text()[-3000:]
        finally:
            stop_process(cli, grace=5.0)
    output = log_path.read_text()
    assert "fabric: torchft lighthouse on 127.0.0.1:" in output
    restarted = "fabric: replica group 2 ended with exit code 137; restarting it (1 of 1), run dir "
    assert restarted + str(tmp_path / "run" / "group2-restart1") in output, output[-3000:]
    records = run.records()
    final = {}
    for group in range(3):
        mine = [r for r in _by_group(records, group) if r["pid"] not in killed]
        steps = [r["committed_steps"] for r in mine]
        assert steps == sorted(steps)  # the step counter never went back
        assert len({r["pid"] for r in mine}) == 1  # the survivors never restarted; group 2 once
        final[group] = (steps[-1], mine[-1]["weights"])
    joined = next(r for r in _by_group(records, 2) if r["pid"] not in killed)
    # restarted at once, it may join while the others still wait out the dead group's step
    assert joined["joined_at"] is not None and joined["joined_at"] >= killed_at
    peers = [r for r in _by_group(records, 0) if r["committed_steps"] == joined["committed_steps"]]
    assert joined["weights"] == peers[0]["weights"]  # the peers' state, received at the join
    assert len(set(map(str, final.values()))) == 1 and final[0][0] == stop  # all three to the stop, equal weights


def _worker() -> Any:
    """tests/scripts/ft_replica_group.py as a module: its model and data."""
    sys.path.insert(0, str(Path(WORKER).parent))
    try:
        import ft_replica_group
    finally:
        sys.path.pop(0)
    return ft_replica_group


def _reference_weights(steps: int) -> list[float]:
    """What one group alone trains in ``steps`` steps (tests/scripts/ft_replica_group.py's model, data and seed)."""
    import torch
    from torch import nn

    worker = _worker()
    torch.manual_seed(7)  # group 0's seed
    model = worker.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        optimizer.zero_grad()
        inputs, targets = worker.batch(step, 0)
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return [value for p in model.parameters() for value in p.detach().reshape(-1).tolist()]


def _reference_data_parallel_weights(
    steps: int,
    shares: int,
    first_shares: int,
    max_norm: float | None = None,
    width: int | None = None,
    accumulate: int = 1,
    expert: bool = False,
) -> list[float]:
    """One process training on every share's batch (in ``accumulate`` microbatches), the gradients averaged over the
    shares (then clipped by norm if ``max_norm``): what data parallelism over all the groups computes. The first step
    has only the first ``first_shares`` shares' gradients in the average where torchft syncs the groups at it (DDP
    groups): the others receive group 0's state in it and send zeros (the step is ``first_shares / shares`` of group
    0's). With ``expert``, the worker's ``WithExpert`` model: its expert takes the branch for some shares, and has no
    gradient (SGD leaves it alone) at a step where none took it."""
    import torch
    from torch import nn

    worker = _worker()
    torch.manual_seed(7)
    model = worker.WithExpert(worker.build_model(width)) if expert else worker.build_model(width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        optimizer.zero_grad()
        for share in range(first_shares if step == 0 else shares):
            inputs, targets = worker.batch(step, share)
            for piece, target in zip(inputs.chunk(accumulate), targets.chunk(accumulate), strict=True):
                outputs = model(piece, worker.uses_expert(step, share)) if expert else model(piece)
                (nn.functional.mse_loss(outputs, target) / (shares * accumulate)).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
    return [value for p in model.parameters() for value in p.detach().reshape(-1).tolist()]


@pytest.mark.end_to_end
def test_the_slurm_form_two_job_steps_of_one_allocation_are_two_groups_and_a_killed_one_rejoins(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """The documented SLURM form: in one allocation, one ``srun`` job step of 2 tasks per replica group (the group's
    variables in its environment), torchft's lighthouse beside them. The steps share the job's id, and the node;
    both train together; group 1's step, its tasks SIGKILLed, is started again with ``srun`` and joins with group 0's
    state, which trained on in its processes."""
    require_modules("fault tolerance", "torchft")
    lighthouse_port = find_free_port()
    lighthouse = slurm_cluster.popen(
        [*(sys.executable, "-m", "fabric_cli", "lighthouse", f"--bind=127.0.0.1:{lighthouse_port}"),
         "--join-timeout-ms=2000", "--heartbeat-timeout-ms=2000"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    stop_file, allocation = tmp_path / "stop", None
    try:
        assert lighthouse.stdout is not None and lighthouse.stdout.readline().startswith(FT_LIGHTHOUSE)
        groups = {FT_REPLICA_GROUPS: "2", FT_LIGHTHOUSE: f"http://127.0.0.1:{lighthouse_port}", "OMP_NUM_THREADS": "1"}
        allocation = slurm_cluster.popen(["salloc", "-n", "4", "--no-shell"], stderr=subprocess.PIPE)
        assert allocation.stderr is not None
        job = re.search(r"Granted job allocation (\d+)", allocation.stderr.readline() + allocation.stderr.readline())
        assert job is not None, "salloc granted no allocation"

        def start_step(group: int, attempt: int) -> subprocess.Popen[str]:
            log = (tmp_path / f"group{group}-{attempt}.log").open("w")
            command = ["srun", f"--jobid={job[1]}", "-n", "2", "--exact", sys.executable, WORKER]
            command += [str(tmp_path), str(stop_file), "--devices=2"]
            variables = {**groups, FT_REPLICA_GROUP: str(group)}
            return slurm_cluster.popen(command, env=variables, stdout=log, stderr=subprocess.STDOUT)

        run = Run(slurm_cluster.namespace, tmp_path, groups=2, devices=2)
        run.processes = {group: start_step(group, 0) for group in range(2)}
        records = run.wait_for(
            "both job steps training together",
            lambda rs: all(any(r["participants"] == 2 for r in _by_group(rs, g)) for g in (0, 1)),
        )
        killed = {r["pid"] for r in _by_group(records, 1)}
        for pid in killed:  # both tasks of the step, as when its node fails
            os.kill(pid, signal.SIGKILL)
        assert run.processes[1].wait(timeout=EVENT_DEADLINE) != 0
        killed_at = _committed(records)
        run.processes[1] = start_step(1, 1)
        records = run.wait_for(
            "group 1's new step training with group 0",
            lambda rs: any(r["pid"] not in killed and r["participants"] == 2 for r in _by_group(rs, 1)),
        )
        stop = _committed(records) + STOP_MARGIN
        run.stop_at(stop)
        for group, process in run.processes.items():
            assert process.wait(timeout=EVENT_DEADLINE) == 0, f"group {group} exited {process.returncode}"
    finally:
        if allocation is not None:
            slurm_cluster.run(["scancel", f"{job[1]}"] if job else ["true"], timeout=30)
            stop_process(allocation, grace=5.0)
        stop_process(lighthouse, grace=5.0)
    records = run.records()
    for rank in range(2):
        survivor = [r for r in _by_group(records, 0) if r["rank"] == rank]
        assert len({r["pid"] for r in survivor}) == 1  # never restarted
        rejoined = [r for r in _by_group(records, 1) if r["rank"] == rank and r["pid"] not in killed]
        assert rejoined[0]["joined_at"] is not None and rejoined[0]["joined_at"] >= killed_at
        peer = next(r for r in survivor if r["committed_steps"] == rejoined[0]["committed_steps"])
        assert rejoined[0]["weights"] == peer["weights"]  # group 0's state, received at the join
        assert survivor[-1]["committed_steps"] == rejoined[-1]["committed_steps"] == stop
        assert survivor[-1]["weights"] == rejoined[-1]["weights"]


@pytest.mark.end_to_end
def test_a_step_retried_while_groups_are_missing_is_said_once_and_once_more_when_it_commits(tmp_path: Path) -> None:
    """Group 0 alone below ``min_replica_groups=2``: each try of its first step is discarded; its log says so once,
    not once per try, and says how many tries it took when group 1 arrives and the step commits."""
    with _fault_tolerant_run(tmp_path, groups=2, devices=1) as run:
        run.stop_at(3)
        options = ("--seed=7", "--min-groups=2")
        alone = run.start_group(0, *options)
        run.wait_for("three discarded tries of group 0", lambda rs: len(rs) >= 3)
        late = run.start_group(1, *options)
        assert [alone.wait(timeout=EVENT_DEADLINE), late.wait(timeout=EVENT_DEADLINE)] == [0, 0]
    tries = [r for r in _by_group(run.records(), 0) if r["committed_steps"] == r["step"]]
    assert len(tries) >= 3 and {r["step"] for r in tries} == {0}, tries
    said = (tmp_path / "group0-0.log").read_text()
    assert said.count("fabric: step 0 was not committed") == 1, said
    assert said.count(f"fabric: step 0 committed after {len(tries)} discarded tries.") == 1, said


@pytest.mark.end_to_end
@pytest.mark.parametrize("strategy", ["fault_tolerant_ddp", "fault_tolerant_fsdp"])
def test_clipping_sees_the_gradients_averaged_over_the_groups(tmp_path: Path, strategy: str) -> None:
    """The groups' gradients were averaged in optimizer.step(), after fabric.clip_gradients had clipped each
    group's own: the average of clipped gradients, not the clipped average, without a word."""
    steps, max_norm = 4, 0.05
    with _fault_tolerant_run(tmp_path, groups=2, devices=1) as run:
        run.stop_at(steps)
        options = (f"--strategy={strategy}", "--seed=7", "--min-groups=2", f"--clip={max_norm}")
        processes = [run.start_group(group, *options) for group in range(2)]
        assert [process.wait(timeout=EVENT_DEADLINE) for process in processes] == [0, 0]
    last = [r for r in run.records() if r["committed_steps"] == steps]
    assert len(last) == 2 and last[0]["weights"] == last[1]["weights"]
    reference = _reference_data_parallel_weights(steps, 2, 1 if strategy == "fault_tolerant_ddp" else 2, max_norm)
    assert last[0]["weights"] == pytest.approx(reference, abs=1e-6)


@pytest.mark.end_to_end
@pytest.mark.parametrize(
    ("strategy", "devices"),
    [("fault_tolerant_ddp", 1), ("fault_tolerant_fsdp", 1), ("fault_tolerant_fsdp", 2), ("fault_tolerant_ddp", 2)],
)
def test_gradients_sent_in_buckets_during_the_backward_and_accumulated_train_as_one_process(
    tmp_path: Path, strategy: str, devices: int
) -> None:
    """A model of over a MiB (two buckets, the first sent while the backward goes on, from DDP's comm hook in DDP
    groups of 2 processes) and two microbatches a step, the first under no_backward_sync: the groups train what one
    process trains on all their data."""
    steps, width = 3, 520
    with _fault_tolerant_run(tmp_path, groups=2, devices=devices, strategy=strategy) as run:
        run.stop_at(steps)
        options = (f"--strategy={strategy}", "--seed=7", "--min-groups=2", f"--width={width}", "--accumulate=2")
        processes = [run.start_group(group, *options) for group in range(2)]
        assert [process.wait(timeout=EVENT_DEADLINE) for process in processes] == [0, 0]
    last = [r for r in run.records() if r["committed_steps"] == steps]
    assert len(last) == 2 * devices and all(r["weights"] == last[0]["weights"] for r in last)
    first_shares = devices if strategy == "fault_tolerant_ddp" else 2 * devices  # DDP groups: group 0's at step 0
    reference = _reference_data_parallel_weights(steps, 2 * devices, first_shares, width=width, accumulate=2)
    assert last[0]["weights"] == pytest.approx(reference, abs=1e-6)


@pytest.mark.end_to_end
@pytest.mark.parametrize(
    ("strategy", "devices"), [("fault_tolerant_ddp", 1), ("fault_tolerant_fsdp", 1), ("fault_tolerant_ddp", 2)]
)
def test_a_layer_only_some_groups_use_at_a_step_trains_as_one_process_on_all_their_data(
    tmp_path: Path, strategy: str, devices: int
) -> None:
    """A branch taken by some shares' batches at a step and by none at others (a mixture of experts' expert): the
    groups without its gradient send zeros, so that the exchanges pair up, and it keeps no gradient only where no
    group had one, as plain DDP over every process leaves it (with DDP groups of 2, also a branch one process of
    a group took)."""
    worker, steps = _worker(), 6
    assert {worker.uses_expert(step, share) for step in range(1, steps) for share in range(2)} == {True, False}
    assert not any(worker.uses_expert(1, share) for share in range(2))  # a step where no group of one takes it
    with _fault_tolerant_run(tmp_path, groups=2, devices=devices, strategy=strategy) as run:
        run.stop_at(steps)
        options = (f"--strategy={strategy}", "--seed=7", "--min-groups=2", "--expert")
        processes = [run.start_group(group, *options) for group in range(2)]
        assert [process.wait(timeout=EVENT_DEADLINE) for process in processes] == [0, 0]
    last = [r for r in run.records() if r["committed_steps"] == steps]
    assert len(last) == 2 * devices and all(r["weights"] == last[0]["weights"] for r in last)
    first_shares = devices if strategy == "fault_tolerant_ddp" else 2 * devices  # DDP groups: group 0's at step 0
    reference = _reference_data_parallel_weights(steps, 2 * devices, first_shares, expert=True)
    assert last[0]["weights"] == pytest.approx(reference, abs=1e-6)


@pytest.mark.end_to_end
def test_a_checkpoint_keeps_the_committed_steps_and_loads_in_a_normal_run_and_back(tmp_path: Path) -> None:
    import torch

    from fabric import Fabric

    saved = tmp_path / "fault-tolerant.ckpt"
    with _fault_tolerant_run(tmp_path, groups=1, devices=1) as run:
        run.stop_at(3)
        assert run.start_group(0, f"--save={saved}").wait(timeout=EVENT_DEADLINE) == 0
        first_pid = run.processes[0].pid
        run.stop_at(5)  # every group lost: the run starts again from the checkpoint
        assert run.start_group(0, f"--load={saved}").wait(timeout=EVENT_DEADLINE) == 0
    assert json.loads((tmp_path / "loaded-group0.json").read_text()) == {"committed_steps": 3}
    records = run.records()
    assert [r["committed_steps"] for r in records if r["pid"] == first_pid] == [1, 2, 3]
    resumed = [r for r in records if r["pid"] != first_pid]
    assert [r["committed_steps"] for r in resumed] == [4, 5]  # counted on, not from 0
    assert resumed[-1]["weights"] == pytest.approx(_reference_weights(5), abs=1e-6)  # as if never interrupted

    # a normal run loads the fault-tolerant checkpoint (the step count is Fabric's own entry, not handed back)
    fabric = Fabric(accelerator="cpu", devices=1)
    model = _worker().build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    assert fabric.load(saved, {"model": model, "optimizer": optimizer}) == {}
    weights = [value for p in model.parameters() for value in p.detach().reshape(-1).tolist()]
    assert weights == pytest.approx(_reference_weights(3), abs=1e-6)

    # and a fault-tolerant run loads a normal checkpoint, saying that it records no committed steps
    normal = tmp_path / "normal.ckpt"
    fabric.save(normal, {"model": model, "optimizer": optimizer})
    (tmp_path / "loaded-group0.json").unlink()
    with _fault_tolerant_run(tmp_path, groups=1, devices=1) as run:
        run.stop_at(1)
        assert run.start_group(0, f"--load={normal}").wait(timeout=EVENT_DEADLINE) == 0
    assert json.loads((tmp_path / "loaded-group0.json").read_text()) == {"committed_steps": 0}
    log = (tmp_path / "group0-0.log").read_text()
    assert f"fabric: {normal} records no committed steps (a run that was not fault-tolerant saved it)" in log


def _share_order(sampler: dict[str, Any], samples: int) -> list[int]:
    """The sample indices a DistributedSampler with these settings yields in its epoch."""
    import torch.utils.data

    order = torch.utils.data.DistributedSampler(
        range(samples),
        num_replicas=sampler["num_replicas"],
        rank=sampler["rank"],
        shuffle=sampler["shuffle"],
        seed=sampler["seed"],
    )
    order.set_epoch(sampler["epoch"])
    return list(order)


@pytest.mark.end_to_end
@pytest.mark.parametrize("strategy", ["fault_tolerant_ddp", "fault_tolerant_fsdp"])
def test_the_trainer_trains_on_when_a_group_dies_rejoins_at_its_data_position_and_leaves_on_sigterm(
    tmp_path: Path, strategy: str
) -> None:
    with _fault_tolerant_run(tmp_path, groups=3, devices=1, worker=TRAINER_WORKER) as run:
        first = {group: run.start_group(group, strategy) for group in range(3)}
        records = run.wait_for(
            "all three groups training together",
            lambda rs: all(any(r["participants"] == 3 for r in _by_group(rs, g)) for g in range(3)),
        )
        first[2].send_signal(signal.SIGKILL)  # its DataLoader worker follows its parent
        first[2].wait()
        killed = first[2].pid
        records = run.wait_for(
            "the two survivors training 3 batches without group 2",
            lambda rs: all(sum(r["participants"] == 2 for r in _by_group(rs, g)) >= 3 for g in (0, 1)),
        )
        run.start_group(2, strategy)
        records = run.wait_for(
            "the restarted group 2 training with the others",
            lambda rs: any(r["pid"] != killed and r["participants"] == 3 for r in _by_group(rs, 2)),
        )
        first[1].send_signal(signal.SIGTERM)  # preemption: group 1 saves and leaves
        assert first[1].wait(timeout=EVENT_DEADLINE) == 75
        left_at = max(r["batch"] for r in _by_group(records, 1))
        records = run.wait_for(
            "groups 0 and 2 training 3 batches after group 1 left",
            lambda rs: all(
                sum(r["participants"] == 2 and r["batch"] > left_at + 1 for r in _by_group(rs, g)) >= 3 for g in (0, 2)
            ),
        )
        stop = max(r["batch"] for r in records) + STOP_MARGIN
        run.stop_at(stop)
        for group in (0, 2):
            assert run.processes[group].wait(timeout=EVENT_DEADLINE) == 0, f"group {group} failed"

    records = run.records()
    survivors = {group: [r for r in _by_group(records, group) if r["pid"] != killed] for group in (0, 2)}
    for mine in survivors.values():
        batches = [r["batch"] for r in mine]
        assert batches == list(range(batches[0], batches[0] + len(batches)))  # one batch after the other, no rewind
        assert batches[-1] == stop
    assert survivors[0][-1]["weights"] == survivors[2][-1]["weights"]  # the same model at the end
    assert len({r["pid"] for r in survivors[0]}) == 1  # group 0 trained through both failures in one process
    # a step the groups discarded is trained again, not counted: each batch of the clock is a committed step
    assert all(r["batch"] == r["committed_steps"] for mine in survivors.values() for r in mine)
    joined = survivors[2][0]
    peer = next(r for r in survivors[0] if r["batch"] == joined["batch"])
    assert joined["joined_at"] is not None
    # the clock and the weights came from a peer: the same batch count, the same weights after it
    assert (joined["epoch"], joined["weights"]) == (peer["epoch"], peer["weights"])
    # and the data position: after the join, the group reads its own share where the run stands (the batch it
    # fetched before it knew the position is not trained: a joining group's gradient is not in the step's average)
    for record in (r for group in (0, 2) for r in survivors[group] if r["joined_at"] is None):
        share = _share_order(record["sampler"], 4096)
        start = (record["batch_in_epoch"] - 1) * 8
        assert record["indices"] == share[start : start + 8], record["batch"]
    assert (tmp_path / "ckpt-group1").is_dir() and any((tmp_path / "ckpt-group1").iterdir())  # saved when preempted


@pytest.mark.end_to_end
def test_the_trainer_autoresumes_every_group_from_its_checkpoint_when_all_are_lost(tmp_path: Path) -> None:
    """Every group lost at once (both SIGKILLed at batch 10, a checkpoint every 4 batches): started again with
    ``autoresume=True``, each group resumes from its batch 8 and retrains batches 9 and 10 to the very weights of the
    first run, its committed steps counted on from the checkpoint's. Every step needs both groups
    (``min_replica_groups=2``): with 1, the group that starts first would train on alone and finish before the other
    joins (this lighthouse's join timeout is 2 s), each then training its own continuation."""
    options = ("fault_tolerant_ddp", "--save-interval=4ba", "--autoresume", "--min-groups=2")
    with _fault_tolerant_run(tmp_path, groups=2, devices=1, worker=TRAINER_WORKER) as run:
        first = {group: run.start_group(group, *options, "--hold-at=10") for group in range(2)}
        run.wait_for(
            "both groups at batch 10", lambda rs: all(any(r["batch"] == 10 for r in _by_group(rs, g)) for g in (0, 1))
        )
        for process in first.values():  # every group lost (its DataLoader worker follows it)
            process.send_signal(signal.SIGKILL)
            process.wait()
        lost = {process.pid for process in first.values()}
        run.stop_at(14)
        again = [run.start_group(group, *options) for group in range(2)]
        for group, process in enumerate(again):
            assert process.wait(timeout=EVENT_DEADLINE) == 0, f"group {group} exited {process.returncode}"

    records = run.records()
    for group in (0, 1):
        before = {r["batch"]: r for r in _by_group(records, group) if r["pid"] in lost}
        after = [r for r in _by_group(records, group) if r["pid"] not in lost]
        assert sorted(before) == list(range(1, 11))
        assert [r["batch"] for r in after] == list(range(9, 15))  # from the checkpoint of batch 8, not from 0
        assert [r["committed_steps"] for r in after] == list(range(9, 15))
        for record in after[:2]:  # the same batches, the same data, the same weights as before the loss
            assert (record["indices"], record["weights"]) == (
                before[record["batch"]]["indices"],
                before[record["batch"]]["weights"],
            )
    assert _by_group(records, 0)[-1]["weights"] == _by_group(records, 1)[-1]["weights"]


@pytest.mark.end_to_end
def test_the_restart_path_redoes_the_steps_since_the_last_checkpoint_on_every_rank(tmp_path: Path) -> None:
    """The comparison the fault-tolerant tests above are measured against: the same failure (one rank SIGKILLed)
    under ``torchrun --max-restarts=1`` with a checkpoint every 4 steps, killed once step 10 is done."""
    every, kill_at = 4, 10
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=3", "--max-restarts=1"),
        *("--monitor-interval=0.1", f"--master-port={find_free_port()}"),
        *(str(REPOSITORY / "tests" / "scripts" / "ddp_restart_job.py"), str(tmp_path), "14", str(every), str(kill_at)),
    ]
    done = subprocess.run(command, env=launcher_environment(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    attempts = [
        [json.loads((tmp_path / f"attempt-{attempt}-rank{rank}.json").read_text()) for rank in range(3)]
        for attempt in (0, 1)
    ]
    assert {rank["started_at"] for rank in attempts[1]} == {8}  # the latest checkpoint
    lost = kill_at - attempts[1][0]["started_at"]
    # steps lost: 2 here (every step since the last checkpoint, up to every - 1 = 3), on every rank, against at most 1
    # with fault tolerance, where only the killed group's processes start again
    assert lost == 2
    assert not {rank["pid"] for rank in attempts[0]} & {rank["pid"] for rank in attempts[1]}  # every rank restarted
