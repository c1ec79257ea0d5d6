"""Real launchers for tests: a one-node SLURM cluster, OpenMPI's ``mpirun`` and MPICH's ``mpiexec``.

Each runs inside a network namespace the fixture creates and deletes, so nothing they open is reachable from
outside (``slurmctld``, ``slurmd`` and ``mpirun`` listen on every address). Commands enter only the network
namespace, with ``nsenter --net``: ``ip netns exec`` also remounts ``/sys``, and ``slurmd`` then finds no cgroups.
Every process a fixture starts is stopped by its pid when the fixture ends. Without the engines, root or ``ip
netns`` a test is skipped, and fails when ``CI=true`` (see ``require_engine``); ``scripts/install_engines.sh``
installs them. ``tests/plugins/environments/test_engine_facts.py`` shows each fixture working;
``/work/shared/ENGINES.md`` has the measurements behind the set-up.

What the SLURM launchers put in a task's environment (SLURM 22.05, measured with these fixtures):

- an ``srun`` step (each task): ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_NTASKS``,
  ``SLURM_STEP_ID`` and ``SLURM_STEPID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_NODELIST``,
  ``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_JOB_ID``, ``SLURM_JOB_NAME`` (the command's name), ``SLURM_NODELIST``,
  ``SLURM_TASKS_PER_NODE``, ``SLURM_SRUN_COMM_HOST``, ``SLURM_LAUNCH_NODE_IPADDR``, ``SLURMD_NODENAME``.
- an ``sbatch`` batch shell (one process, not a step): ``SLURM_PROCID=0``, ``SLURM_LOCALID=0``, ``SLURM_NODEID=0``,
  ``SLURM_NTASKS`` (the tasks asked for, not 1), ``SLURM_JOB_ID``, ``SLURM_JOB_NAME`` (the script's name),
  ``SLURM_NODELIST``, ``SLURM_TASKS_PER_NODE``, ``SLURMD_NODENAME``; no ``SLURM_STEP_ID``, ``SLURM_STEPID`` or
  other ``SLURM_STEP_*``, no ``SLURM_SRUN_COMM_HOST``.
- a command under ``salloc`` (runs where salloc runs, not as a task): ``SLURM_JOB_ID``, ``SLURM_JOB_NAME=interactive``,
  ``SLURM_NTASKS``, ``SLURM_NODELIST``, ``SLURM_TASKS_PER_NODE``; no ``SLURM_PROCID``, ``SLURM_LOCALID``,
  ``SLURM_NODEID``, ``SLURM_STEP_ID`` or ``SLURMD_NODENAME``.

``srun`` passes the tasks' output on line by line, but splits a line over about 1 KiB, and the other task's output
can land in between: print short lines, or use ``--label`` or ``--output``.

The MPI launchers need no daemon and run in a namespace with only its loopback up. OpenMPI 4.1 as root needs
``--allow-run-as-root`` and, for more ranks than cores, ``--oversubscribe``; it sets ``OMPI_COMM_WORLD_RANK``,
``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE`` and ``_NODE_RANK`` (the rank within the node, not the node's index).
MPICH 4.0 (hydra) sets ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS`` (and ``PMI_FD``).
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

REPOSITORY = Path(__file__).resolve().parent.parent
#: Variables a launcher started by a test must not inherit: they would point it at the test runner's own job.
INHERITED_LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "HYDRA_", "MPI_LOCAL")
#: The CPUs the SLURM node offers: more than this machine's 2 cores, so a 4-task job starts instead of pending.
SLURM_CPUS = 4
SLURM_START_TIMEOUT = 30.0
_namespace_numbers = itertools.count()


def require_engine(name: str, *executables: str) -> None:
    """Skip the test when an executable of engine ``name`` is missing; fail instead under CI (``CI=true``)."""
    missing = [executable for executable in executables if shutil.which(executable) is None]
    if missing:
        _unavailable(f"{name} needs {', '.join(missing)} (scripts/install_engines.sh installs it)")


def require_modules(name: str, *modules: str) -> None:
    """Skip the test when a Python package of engine ``name`` is missing; fail instead under CI (``CI=true``)."""
    import importlib.util

    missing = [module for module in modules if importlib.util.find_spec(module) is None]
    if missing:
        _unavailable(f"{name} needs the Python packages {', '.join(missing)} (pip install -e '.[test]')")


def require_namespaces(name: str) -> None:
    """Skip (or fail under CI) when this process cannot make network namespaces: root, ``ip`` and ``nsenter``."""
    require_engine(name, "ip", "nsenter")
    if os.geteuid() != 0:
        _unavailable(f"{name} needs root to make a network namespace")


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must have every engine", pytrace=False)
    pytest.skip(reason)


def launcher_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a launched task: no inherited launcher variables, this interpreter first
    on ``PATH`` (``python`` in a command is ``sys.executable``), the repository on ``PYTHONPATH`` (tasks start in
    other directories), then ``extra``."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith(INHERITED_LAUNCHER_PREFIXES)}
    environment["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), environment.get("PATH", "")])
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPOSITORY), environment.get("PYTHONPATH")]))
    environment.update(extra or {})
    return environment


def stop_process(process: subprocess.Popen[bytes] | subprocess.Popen[str], grace: float = 10.0) -> None:
    """SIGTERM ``process``, then SIGKILL if it is still running after ``grace`` seconds; reaps it."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class NetworkNamespace:
    """A network namespace this process made; ``run``/``popen`` start commands inside it (network only)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.prefix = ["nsenter", f"--net=/var/run/netns/{name}"]

    def popen(self, args: list[str], env: Mapping[str, str], cwd: Path, **options: Any) -> subprocess.Popen[str]:
        """Start ``args`` in the namespace; stdout and stderr are pipes unless ``options`` say otherwise."""
        options = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **options}
        return subprocess.Popen([*self.prefix, *args], env=env, cwd=cwd, text=True, **options)

    def run(
        self, args: list[str], env: Mapping[str, str], cwd: Path, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """Run ``args`` in the namespace to its end (killed past ``timeout``); its output is captured."""
        process = self.popen(args, env, cwd)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        finally:
            stop_process(process, grace=2.0)
        return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextmanager
def network_namespace(kind: str, *, veth: bool) -> Iterator[NetworkNamespace]:
    """A new namespace, named after ``kind`` and this pid, with loopback up, deleted on exit. ``veth`` adds a pair
    with both ends inside (198.18.201.1/30 and .2/30): a non-loopback address, without which glibc (AI_ADDRCONFIG)
    cannot resolve the host name and SLURM does not start."""
    name = f"fab-{kind}-{os.getpid()}-{next(_namespace_numbers)}"
    try:
        try:
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
            if veth:
                _ip("-n", name, "link", "add", "veth0", "type", "veth", "peer", "name", "veth1")
                for end, link in enumerate(("veth0", "veth1")):
                    _ip("-n", name, "addr", "add", f"198.18.201.{end + 1}/30", "dev", link)
                    _ip("-n", name, "link", "set", link, "up")
        except subprocess.CalledProcessError as error:
            raise RuntimeError(f"`{' '.join(error.cmd)}` failed: {error.stderr.decode().strip()}") from error
        yield NetworkNamespace(name)
    finally:  # deleting the namespace deletes the veth pair in it
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False, timeout=30)


class NodePair:
    """Two "machines": namespaces joined by a veth pair (198.18.N.1 and 198.18.N.2), each with its loopback and its
    end of the pair, and a hostname that still resolves to 127.0.0.1, where gloo advertises loopback and the other
    node is refused unless told which interface to use. ``with NodePair() as nodes``; ``nodes.command(i, argv)``
    runs ``argv`` on node ``i``."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.names = (f"fabA{tag}", f"fabB{tag}")
        self.interfaces = (f"fvA{tag}", f"fvB{tag}")
        self.subnet = f"198.18.{os.getpid() % 250}"

    def address(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}"

    def interface(self, node: int) -> str:
        return self.interfaces[node]

    def command(self, node: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[node], *argv]

    def __enter__(self) -> NodePair:
        require_namespaces("two nodes")
        try:
            for name in self.names:
                _ip("netns", "add", name)
            _ip("link", "add", self.interfaces[0], "type", "veth", "peer", "name", self.interfaces[1])
            for node, (name, link) in enumerate(zip(self.names, self.interfaces, strict=True)):
                _ip("link", "set", link, "netns", name)
                _ip("-n", name, "addr", "add", f"{self.address(node)}/24", "dev", link)
                _ip("-n", name, "link", "set", link, "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as error:
            self._remove()
            raise RuntimeError(f"`ip netns` failed: {error.stderr.decode().strip()}") from error
        return self

    def __exit__(self, *exc: object) -> None:
        self._remove()

    def _remove(self) -> None:
        for name in self.names:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


#: The states of a job that has ended (``scontrol show job``'s ``JobState``).
ENDED_JOB_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
)


class SlurmCluster:
    """A one-node SLURM cluster (munged, slurmctld, slurmd) in its own namespace, all its files in ``directory``.

    ``run``/``popen`` start a client command (``srun``, ``salloc``, ``scancel``, ``squeue``) in
    the namespace with ``SLURM_CONF`` set and the environment of ``launcher_environment``, in ``directory`` unless
    ``cwd`` says otherwise; ``srun`` and ``sbatch`` pass that environment on to the tasks.
    """

    partition = "fabric"

    def __init__(self, namespace: NetworkNamespace, directory: Path) -> None:
        self.namespace = namespace
        self.directory = directory
        self.config = directory / "slurm.conf"
        self.daemons: dict[str, subprocess.Popen[str]] = {}

    def environment(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """``launcher_environment(extra)`` with this cluster's ``SLURM_CONF``."""
        return launcher_environment({**(extra or {}), "SLURM_CONF": str(self.config)})

    def run(
        self,
        args: list[str],
        env: Mapping[str, str] | None = None,
        timeout: float = 120.0,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a client command to its end; its output is captured."""
        return self.namespace.run(args, self.environment(env), cwd or self.directory, timeout)

    def popen(
        self, args: list[str], env: Mapping[str, str] | None = None, cwd: Path | None = None, **options: Any
    ) -> subprocess.Popen[str]:
        """Start a client command the test signals or waits for itself (``stop_process`` it in a ``finally``)."""
        return self.namespace.popen(args, self.environment(env), cwd or self.directory, **options)

    def batch(self, args: list[str], timeout: float = 120.0) -> int:
        """Submit a batch job (``sbatch ARGS``) and wait for its end; its exit code. ``sbatch --wait`` polls at growing
        intervals up to 10 s, so it returned up to that long after the job ended; here ``scontrol`` is asked every
        0.1 s (the controller keeps an ended job's record for MinJobAge, 300 s by default)."""
        submitted = self.run(["sbatch", "--parsable", *args], timeout=30)
        if submitted.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {submitted.stderr}")
        job = submitted.stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            record = dict(
                field.split("=", 1)
                for field in self.run(["scontrol", "-o", "show", "job", job], timeout=30).stdout.split()
                if "=" in field
            )
            if record.get("JobState") in ENDED_JOB_STATES:
                code, signal_number = (int(part) for part in record["ExitCode"].split(":"))
                return 128 + signal_number if signal_number else code  # as a shell reports a signalled command
            time.sleep(0.1)
        raise TimeoutError(f"batch job {job} did not end within {timeout:.0f} s")

    def job_ids(self) -> list[str]:
        """The ids of the jobs the cluster holds, pending or running."""
        return self.run(["squeue", "-h", "-o", "%i"], timeout=30).stdout.split()

    def start(self) -> None:
        """Write the key and configuration, start the three daemons and wait until the node is idle."""
        munge = self._write_munge_key()
        self._write_config(munge / "socket" / "munge.socket")
        self._start_daemon(
            "munged",
            # --force: pytest's temporary root is mode 700, which munged's check of the socket's path only warns of
            ["munged", "--foreground", "--force", f"--key-file={munge / 'key' / 'munge.key'}",
             f"--socket={munge / 'socket' / 'munge.socket'}", f"--pid-file={munge / 'munged.pid'}",
             f"--seed-file={munge / 'munged.seed'}", f"--log-file={self.directory / 'log' / 'munged.log'}"],
        )  # fmt: skip
        self._wait_for("munged's socket", lambda: (munge / "socket" / "munge.socket").exists())
        self._start_daemon("slurmctld", ["slurmctld", "-D", "-c"])  # -c: no state from an earlier run
        self._start_daemon("slurmd", ["slurmd", "-D"])
        self._wait_for(
            "an idle node", lambda: self.run(["sinfo", "-h", "-o", "%T"], timeout=10).stdout.strip() == "idle"
        )

    def stop(self) -> None:
        """Cancel every job (so no slurmstepd outlives the cluster), then stop the daemons, last started first."""
        try:
            if self.daemons.get("slurmctld") and self.daemons["slurmctld"].poll() is None:
                self.run(["scancel", f"--partition={self.partition}"], timeout=30)
                deadline = time.monotonic() + 15
                while self.job_ids() and time.monotonic() < deadline:
                    time.sleep(0.2)
        finally:
            for daemon in reversed(self.daemons.values()):
                stop_process(daemon)

    def _write_munge_key(self) -> Path:
        """munged as root refuses the packaged key (owned by user munge): its own 128-byte key, mode 600 in a 700
        directory, and a socket directory of mode 755."""
        munge = self.directory / "munge"
        (munge / "key").mkdir(parents=True, mode=0o700)
        (munge / "socket").mkdir(mode=0o755)
        (self.directory / "log").mkdir()
        key = munge / "key" / "munge.key"
        key.touch(mode=0o600)
        key.write_bytes(os.urandom(128))
        return munge

    def _write_config(self, munge_socket: Path) -> None:
        host = socket.gethostname().split(".")[0]
        state, spool = self.directory / "state", self.directory / "spool"
        state.mkdir()
        spool.mkdir()
        settings = {
            "ClusterName": "fabric",
            "SlurmctldHost": host,
            "SlurmUser": "root",
            "SlurmdUser": "root",
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            "AuthInfo": f"socket={munge_socket}",
            "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_CPU",
            "SlurmdParameters": "config_overrides",  # the node has SLURM_CPUS even with fewer cores
            "MpiDefault": "none",
            "AccountingStorageType": "accounting_storage/none",
            "JobAcctGatherType": "jobacct_gather/none",
            "JobCompType": "jobcomp/none",
            "ReturnToService": "2",
            "StateSaveLocation": state,
            "SlurmdSpoolDir": spool,
            "SlurmctldPidFile": self.directory / "slurmctld.pid",
            "SlurmdPidFile": self.directory / "slurmd.pid",
            "NodeName": f"{host} CPUs={SLURM_CPUS} State=UNKNOWN",
            # FORCE: jobs share the CPUs without asking, so a second job starts while a first one holds them all
            "PartitionName": f"{self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4",
        }
        self.config.write_text("".join(f"{key}={value}\n" for key, value in settings.items()))

    def _start_daemon(self, name: str, args: list[str]) -> None:
        """Start a daemon in the foreground (its pid is ours to stop: the daemons delete their pid files early),
        its output in ``log/NAME.out``."""
        with open(self.directory / "log" / f"{name}.out", "w") as log:
            self.daemons[name] = self.namespace.popen(
                args, self.environment(), self.directory, stdout=log, stderr=subprocess.STDOUT
            )

    def _wait_for(self, what: str, ready: Callable[[], bool]) -> None:
        """Poll ``ready`` until true; raise with the daemons' logs if one of them ended or it takes too long."""
        deadline = time.monotonic() + SLURM_START_TIMEOUT
        while not ready():
            ended = [name for name, daemon in self.daemons.items() if daemon.poll() is not None]
            if ended or time.monotonic() > deadline:
                problem = f"{', '.join(ended)} ended" if ended else f"no {what} after {SLURM_START_TIMEOUT:.0f} s"
                raise RuntimeError(f"the SLURM cluster did not start: {problem}\n{self._log_tails()}")
            time.sleep(0.1)

    def _log_tails(self, lines: int = 20) -> str:
        tails = []
        for log in sorted((self.directory / "log").iterdir()):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            tails.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(tails)


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A running one-node SLURM cluster for the tests of one module (about 1.1 s to start)."""
    require_engine(
        "SLURM", "munged", "slurmctld", "slurmd", "srun", "sbatch", "salloc", "scancel", "squeue", "sinfo", "scontrol"
    )
    require_namespaces("SLURM")
    with network_namespace("slurm", veth=True) as namespace:
        cluster = SlurmCluster(namespace, tmp_path_factory.mktemp("slurm"))
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()


class MpiLaunchers:
    """OpenMPI's and MPICH's launchers in a namespace of their own (loopback only), with ``MASTER_ADDR`` and a
    ``MASTER_PORT`` for torch: ``run(mpi.openmpi([...]))``. Each launch gets the next port from 29500 up, free in
    this new namespace, so a socket the previous launch left in TIME_WAIT never matters."""

    def __init__(self, namespace: NetworkNamespace, directory: Path) -> None:
        self.namespace = namespace
        self.directory = directory
        self._ports = itertools.count(29500)

    def openmpi(self, command: list[str], processes: int = 2) -> list[str]:
        """``mpirun`` (OpenMPI) starting ``command`` ``processes`` times."""
        require_engine("OpenMPI", "mpirun")
        port = next(self._ports)
        return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(processes),
                "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={port}", *command]  # fmt: skip

    def mpich(self, command: list[str], processes: int = 2) -> list[str]:
        """``mpiexec.mpich`` (MPICH's hydra) starting ``command`` ``processes`` times."""
        require_engine("MPICH", "mpiexec.mpich")
        port = next(self._ports)
        return ["mpiexec.mpich", "-n", str(processes),
                "-genv", "MASTER_ADDR", "127.0.0.1", "-genv", "MASTER_PORT", str(port), *command]  # fmt: skip

    def run(
        self, args: list[str], env: Mapping[str, str] | None = None, timeout: float = 120.0, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a launcher command to its end; its output is captured."""
        return self.namespace.run(args, launcher_environment(env), cwd or self.directory, timeout)

    def popen(
        self, args: list[str], env: Mapping[str, str] | None = None, cwd: Path | None = None, **options: Any
    ) -> subprocess.Popen[str]:
        """Start a launcher command the test signals or waits for itself (``stop_process`` it in a ``finally``)."""
        return self.namespace.popen(args, launcher_environment(env), cwd or self.directory, **options)


@pytest.fixture
def mpi_launchers(tmp_path: Path) -> Iterator[MpiLaunchers]:
    """The MPI launchers, in a namespace made for this test; a test using one that is missing is skipped."""
    require_namespaces("MPI")
    with network_namespace("mpi", veth=False) as namespace:
        yield MpiLaunchers(namespace, tmp_path)
