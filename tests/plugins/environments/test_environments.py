"""Cluster environments read the launcher's variables correctly, and detection picks the right one."""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from fabric.plugins.environments import (
    ENVIRONMENT_REGISTRY,
    ClusterEnvironment,
    KubeflowEnvironment,
    LocalEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
    detect_environment,
    expand_hostlist,
    find_free_port,
)
from fabric.plugins.environments.cluster_environment import LaunchedLayout
from fabric.plugins.environments.slurm import expand_tasks_per_node

#: Every variable any environment reads; each test starts with none of them set.
ALL_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "SLURM_NTASKS",
    "SLURM_JOB_NAME",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NODELIST",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_ID",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_STEP_ID",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "OMPI_COMM_WORLD_NODE_RANK",
    "PMI_SIZE",
    "PMI_RANK",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "KUBERNETES_PORT",
    "LSB_JOBID",
    "LSB_DJOB_RANKFILE",
    "JSM_NAMESPACE_SIZE",
    "JSM_NAMESPACE_RANK",
    "JSM_NAMESPACE_LOCAL_RANK",
    "JSM_NAMESPACE_LOCAL_SIZE",
)

TORCHRUN_VARIABLES = {
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29400",
    "WORLD_SIZE": "8",
    "RANK": "5",
    "LOCAL_RANK": "1",
    "GROUP_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "TORCHELASTIC_RUN_ID": "run-1",
}

SLURM_VARIABLES = {
    "SLURM_NTASKS": "8",
    "SLURM_JOB_NAME": "train.sh",
    "SLURM_PROCID": "6",
    "SLURM_LOCALID": "2",
    "SLURM_NODEID": "1",
    "SLURM_NODELIST": "gpu[007-008]",
    "SLURM_JOB_ID": "1234567",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
}


@pytest.fixture(autouse=True)
def _clear_cluster_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ALL_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _set(monkeypatch: pytest.MonkeyPatch, variables: Mapping[str, str]) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def _ranks(env: ClusterEnvironment) -> tuple[int, int, int, int]:
    return env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()


# --- local -----------------------------------------------------------------------------------------


def test_local_defaults() -> None:
    env = LocalEnvironment()
    assert LocalEnvironment.detect()
    assert not env.creates_processes_externally
    assert env.main_address == "127.0.0.1"
    assert _ranks(env) == (1, 0, 0, 0)
    env.teardown()


def test_local_reads_variables_and_setters(monkeypatch: pytest.MonkeyPatch) -> None:
    env = LocalEnvironment()  # created before the variables are set: values are read on each call
    _set(monkeypatch, {"MASTER_ADDR": "1.2.3.4", "MASTER_PORT": "4321", "LOCAL_RANK": "3", "GROUP_RANK": "2"})
    env.set_world_size(8)
    env.set_global_rank(7)
    assert env.creates_processes_externally
    assert (env.main_address, env.main_port) == ("1.2.3.4", 4321)
    assert _ranks(env) == (8, 7, 3, 2)
    monkeypatch.setenv("NODE_RANK", "5")  # NODE_RANK wins over GROUP_RANK
    assert env.node_rank() == 5
    with pytest.raises(ValueError, match="world size"):
        env.set_world_size(0)
    with pytest.raises(ValueError, match="global rank"):
        env.set_global_rank(-1)


def test_local_free_port_is_bindable_and_stable() -> None:
    env = LocalEnvironment()
    port = env.main_port
    assert isinstance(port, int)
    assert 1024 <= port <= 65535
    assert env.main_port == port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
    assert 1024 <= find_free_port() <= 65535


def test_invalid_integer_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "zero")
    with pytest.raises(ValueError, match=r"LOCAL_RANK='zero' must be an integer"):
        LocalEnvironment().local_rank()


# --- torchelastic ----------------------------------------------------------------------------------


def test_torchelastic(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not TorchElasticEnvironment.detect()
    _set(monkeypatch, TORCHRUN_VARIABLES)
    assert TorchElasticEnvironment.detect()
    env = TorchElasticEnvironment()
    assert env.creates_processes_externally
    assert (env.main_address, env.main_port) == ("10.0.0.1", 29400)
    assert _ranks(env) == (8, 5, 1, 1)
    assert env.launched_layout() == LaunchedLayout("torchrun", world_size=8, local_world_size=4)


# --- SLURM -----------------------------------------------------------------------------------------


def test_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, SLURM_VARIABLES)
    assert SLURMEnvironment.detect()
    env = SLURMEnvironment()
    assert env.creates_processes_externally
    assert env.main_address == "gpu007"
    assert env.main_port == 10000 + 4567
    assert _ranks(env) == (8, 6, 2, 1)
    assert env.launched_layout() == LaunchedLayout("SLURM's srun", world_size=8, local_world_size=4, num_nodes=2)


def test_an_sbatch_script_without_srun_is_not_a_slurm_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch shell sees the job's SLURM_NTASKS but is one process no srun started (no SLURM_STEP_ID):
    taking it for a task of a 2-task step made it wait 30 minutes for a rank that never comes."""
    _set(monkeypatch, SLURM_VARIABLES)
    monkeypatch.delenv("SLURM_STEP_ID")
    assert not SLURMEnvironment.detect()
    assert type(detect_environment()) is LocalEnvironment


@pytest.mark.parametrize(
    ("counts", "node", "expected"), [("2", 0, 2), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1), ("3,1(x2)", 2, 1)]
)
def test_slurm_tasks_on_this_node(monkeypatch: pytest.MonkeyPatch, counts: str, node: int, expected: int) -> None:
    _set(monkeypatch, {**SLURM_VARIABLES, "SLURM_STEP_TASKS_PER_NODE": counts, "SLURM_NODEID": str(node)})
    assert SLURMEnvironment().local_world_size() == expected
    monkeypatch.delenv("SLURM_STEP_TASKS_PER_NODE")
    assert SLURMEnvironment().local_world_size() is None
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", counts)  # the job's, when the step does not say
    assert SLURMEnvironment().local_world_size() == expected


@pytest.mark.parametrize("counts", ["2(x", "x2", "2(x3", "", "2,,1"])
def test_slurm_tasks_per_node_rejects_what_it_cannot_read(counts: str) -> None:
    with pytest.raises(ValueError, match="tasks-per-node"):
        expand_tasks_per_node(counts)


def test_an_interactive_shell_step_is_not_detected_but_srun_inside_salloc_is(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, {**SLURM_VARIABLES, "SLURM_JOB_NAME": "bash"})  # srun --pty bash
    assert not SLURMEnvironment.detect()
    monkeypatch.setenv("SLURM_JOB_NAME", "interactive")  # salloc's job name, inherited by its srun steps
    assert SLURMEnvironment.detect()


@pytest.mark.parametrize(
    ("nodelist", "expected"),
    [
        ("host1", ["host1"]),
        ("host1,host2", ["host1", "host2"]),
        ("node[001-003,007],gpu-[1-2]", ["node001", "node002", "node003", "node007", "gpu-1", "gpu-2"]),
        ("a[1,3-4]b", ["a1b", "a3b", "a4b"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("x[9],y.example.com", ["x9", "y.example.com"]),
    ],
)
def test_expand_hostlist(nodelist: str, expected: list[str]) -> None:
    assert expand_hostlist(nodelist) == expected


@pytest.mark.parametrize("nodelist", ["node[1-3", "node1-3]", "node[3-1]", "node[a-b]", "", "node[[1]]"])
def test_expand_hostlist_rejects_invalid(nodelist: str) -> None:
    with pytest.raises(ValueError, match="hostlist"):
        expand_hostlist(nodelist)


@pytest.mark.parametrize(
    ("nodelist", "first_host"),
    [("node[001-003,007],gpu-[1-2]", "node001"), ("gpu-[10-12]", "gpu-10"), ("login3,login4", "login3")],
)
def test_slurm_main_address_is_first_host(monkeypatch: pytest.MonkeyPatch, nodelist: str, first_host: str) -> None:
    _set(monkeypatch, {**SLURM_VARIABLES, "SLURM_NODELIST": nodelist})
    assert SLURMEnvironment().main_address == first_host


def test_slurm_job_nodelist_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, SLURM_VARIABLES)
    monkeypatch.delenv("SLURM_NODELIST")
    with pytest.raises(ValueError, match="SLURM_NODELIST"):
        _ = SLURMEnvironment().main_address
    monkeypatch.setenv("SLURM_JOB_NODELIST", "c[05-06]")
    assert SLURMEnvironment().main_address == "c05"


@pytest.mark.parametrize(("job_id", "port"), [("1234567", 14567), ("42", 10042), ("990000", 10000)])
def test_slurm_port_from_job_id(monkeypatch: pytest.MonkeyPatch, job_id: str, port: int) -> None:
    _set(monkeypatch, {**SLURM_VARIABLES, "SLURM_JOB_ID": job_id})
    assert SLURMEnvironment().main_port == port
    monkeypatch.setenv("MASTER_PORT", "12345")
    assert SLURMEnvironment().main_port == 12345


def test_job_steps_of_one_allocation_side_by_side_get_their_own_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ``srun`` steps of one job on one node (fault tolerance's replica groups) both bound the job's port: the
    second failed with EADDRINUSE. Each step of the job's first thousand has its own port, below the ephemeral
    ones; step 0 keeps the job's."""
    _set(monkeypatch, {**SLURM_VARIABLES, "SLURM_JOB_ID": "1234567"})
    ports = []
    for step in range(1000):
        monkeypatch.setenv("SLURM_STEP_ID", str(step))
        ports.append(SLURMEnvironment().main_port)
    assert ports[:3] == [14567, 24567, 11799]
    assert len(set(ports)) == len(ports) and all(10000 <= port < 32768 for port in ports)
    monkeypatch.setenv("SLURM_STEP_ID", "batch")
    with pytest.raises(ValueError, match=r"SLURM_JOB_ID='1234567' and SLURM_STEP_ID='batch'; set MASTER_PORT"):
        _ = SLURMEnvironment().main_port


# --- MPI -------------------------------------------------------------------------------------------


def test_mpi_openmpi(monkeypatch: pytest.MonkeyPatch) -> None:
    openmpi = {
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_RANK": "6",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        "MASTER_ADDR": "head",
    }
    _set(monkeypatch, openmpi)
    assert MPIEnvironment.detect()
    env = MPIEnvironment()
    assert env.creates_processes_externally
    assert (env.main_address, env.main_port) == ("head", 29500)
    assert _ranks(env) == (8, 6, 2, 1)  # node derived as 6 // 4
    assert env.launched_layout() == LaunchedLayout("mpirun", world_size=8, local_world_size=4)
    # OpenMPI's NODE_RANK is the rank within the node (2 here), not the node's index: it is not read
    _set(monkeypatch, {"OMPI_COMM_WORLD_NODE_RANK": "2", "MASTER_PORT": "1111"})
    assert env.node_rank() == 1
    assert env.main_port == 1111


def test_mpi_mpich(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(
        monkeypatch,
        {"PMI_SIZE": "6", "PMI_RANK": "5", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3", "MASTER_ADDR": "h0"},
    )
    assert MPIEnvironment.detect()
    assert detect_environment().__class__ is MPIEnvironment
    assert _ranks(MPIEnvironment()) == (6, 5, 2, 1)
    assert _ranks(MPIEnvironment()) == (6, 5, 2, 1)


def test_mpi_missing_master_addr(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, {"PMI_SIZE": "2", "PMI_RANK": "0"})
    with pytest.raises(ValueError, match=r"MASTER_ADDR.*export MASTER_ADDR"):
        _ = MPIEnvironment().main_address


# --- Kubeflow --------------------------------------------------------------------------------------


def test_kubeflow(monkeypatch: pytest.MonkeyPatch) -> None:
    pytorchjob = {
        "KUBERNETES_PORT": "tcp://10.96.0.1:443",
        "MASTER_ADDR": "job-master-0",
        "MASTER_PORT": "23456",
        "WORLD_SIZE": "4",
        "RANK": "3",
    }
    _set(monkeypatch, pytorchjob)
    assert KubeflowEnvironment.detect()
    env = KubeflowEnvironment()
    assert env.creates_processes_externally
    assert (env.main_address, env.main_port) == ("job-master-0", 23456)
    assert _ranks(env) == (4, 3, 0, 3)
    assert isinstance(detect_environment(), KubeflowEnvironment)
    monkeypatch.setenv("LOCAL_RANK", "0")  # torchrun inside the pod: not a plain PyTorchJob process
    assert not KubeflowEnvironment.detect()


# --- LSF -------------------------------------------------------------------------------------------


def test_lsf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rankfile = tmp_path / "rankfile"
    rankfile.write_text("launch\n" + "nodeA\n" * 4 + "nodeB.cluster.org\n" * 4 + "\n")
    lsf = {
        "LSB_JOBID": "98765",
        "LSB_DJOB_RANKFILE": str(rankfile),
        "JSM_NAMESPACE_SIZE": "8",
        "JSM_NAMESPACE_RANK": "5",
        "JSM_NAMESPACE_LOCAL_RANK": "1",
    }
    _set(monkeypatch, lsf)
    monkeypatch.setattr(socket, "gethostname", lambda: "nodeB")
    assert LSFEnvironment.detect()
    env = LSFEnvironment()
    assert env.creates_processes_externally
    assert (env.main_address, env.main_port) == ("nodeA", 18765)
    assert _ranks(env) == (8, 5, 1, 1)
    assert isinstance(detect_environment(), LSFEnvironment)
    monkeypatch.setattr(socket, "gethostname", lambda: "elsewhere")
    with pytest.raises(ValueError, match="not among the compute hosts"):
        env.node_rank()


# --- detection -------------------------------------------------------------------------------------


def test_registry_order_is_detection_priority() -> None:
    assert ENVIRONMENT_REGISTRY.names()[:6] == ["torchelastic", "slurm", "kubeflow", "lsf", "mpi", "local"]


def test_detect_torchrun_inside_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, {**SLURM_VARIABLES, **TORCHRUN_VARIABLES})
    assert isinstance(detect_environment(), TorchElasticEnvironment)


def test_detect_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, SLURM_VARIABLES)
    assert isinstance(detect_environment(), SLURMEnvironment)


def test_detect_interactive_slurm_is_local(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, {**SLURM_VARIABLES, "SLURM_JOB_NAME": "bash"})
    assert type(detect_environment()) is LocalEnvironment


def test_detect_nothing_is_local() -> None:
    env = detect_environment()
    assert type(env) is LocalEnvironment
    assert not env.creates_processes_externally


def test_detect_from_explicit_mapping() -> None:
    environ = {**SLURM_VARIABLES}
    env = detect_environment(environ)
    assert isinstance(env, SLURMEnvironment)
    assert env.environ is environ
    assert env.global_rank() == 6
    assert type(detect_environment({})) is LocalEnvironment


class MyClusterEnvironment(ClusterEnvironment):
    """A user's scheduler that exports ``MY_RANK`` and ``MY_SIZE``."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "scheduler-head"

    @property
    def main_port(self) -> int:
        return 4000

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> bool:
        return "MY_RANK" in cls._resolve_environ(environ)

    def world_size(self) -> int:
        return self._int("MY_SIZE")

    def global_rank(self) -> int:
        return self._int("MY_RANK")

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return self.global_rank()


@pytest.fixture
def _registered_custom_environment() -> Iterator[None]:
    ENVIRONMENT_REGISTRY.register("mine", MyClusterEnvironment, description="a user's scheduler")
    try:
        yield
    finally:
        ENVIRONMENT_REGISTRY.unregister("mine")


def test_user_defined_environment() -> None:
    env = MyClusterEnvironment({"MY_RANK": "2", "MY_SIZE": "3"})
    assert _ranks(env) == (3, 2, 0, 2)
    assert (env.main_address, env.main_port, env.creates_processes_externally) == ("scheduler-head", 4000, True)
    env.validate_settings(num_devices=1, num_nodes=3)  # the defaults are no-ops
    env.teardown()
    with pytest.raises(TypeError, match="abstract"):
        ClusterEnvironment()  # type: ignore[abstract]


@pytest.mark.usefixtures("_registered_custom_environment")
def test_user_defined_environment_is_detected_before_local(monkeypatch: pytest.MonkeyPatch) -> None:
    assert type(detect_environment()) is LocalEnvironment
    _set(monkeypatch, {"MY_RANK": "1", "MY_SIZE": "2"})
    env = detect_environment()
    assert isinstance(env, MyClusterEnvironment)
    assert env.global_rank() == 1
    _set(monkeypatch, SLURM_VARIABLES)  # built-in environments registered earlier keep priority
    assert isinstance(detect_environment(), SLURMEnvironment)
