"""``ddp_spawn`` / ``ddp_fork`` / ``ddp_notebook``: run a function in N new processes, return rank 0's result.

Every rank is a child; this process only waits. If a rank raises, its traceback is re-raised here
(naming the rank) and the other ranks are stopped. Rank 0's return value travels back through a
queue, so it must be picklable; tensors are moved to the CPU first.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import subprocess
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_ready
from typing import Any, Literal

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from fabric.plugins.environments.cluster_environment import ClusterEnvironment
from fabric.strategies.launchers.launcher import Launcher
from fabric.utilities.peer_loss import peer_gone_text
from fabric.utilities.processes.exit import exit_process
from fabric.utilities.processes.rank_environment import rank_variables
from fabric.utilities.processes.supervision import describe_exit, exits_in_order, oom_kill_count, stop_processes


class RankFailedError(RuntimeError):
    """A launched rank raised; the message carries its traceback."""


class MultiProcessLauncher(Launcher):
    def __init__(
        self, num_processes: int, cluster_environment: ClusterEnvironment, start_method: Literal["spawn", "fork"]
    ) -> None:
        if start_method not in multiprocessing.get_all_start_methods():
            raise ValueError(
                f"start_method={start_method!r} is not available on this platform. "
                f"Available: {multiprocessing.get_all_start_methods()}."
            )
        self.num_processes = num_processes
        self.cluster_environment = cluster_environment
        self.start_method = start_method

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return self.start_method == "fork"  # spawn must re-import the function from a file

    @property
    @override
    def runs_only_the_function(self) -> bool:
        return True

    @override
    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.start_method == "fork" and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            raise RuntimeError(
                "CUDA was initialised before fabric.launch(), and forked processes cannot use it. Move the "
                "CUDA calls after launch(), or use strategy='ddp_spawn'."
            )
        context: Any = multiprocessing.get_context(self.start_method)
        processes, readers = [], []
        oom_kills_before = oom_kill_count()
        for local_rank in range(self.num_processes):
            reader, writer = context.Pipe(duplex=False)  # one channel per rank: results never block on a full pipe
            process = context.Process(
                target=_run_rank,
                args=(local_rank, self._rank_variables(local_rank), writer, function, args, kwargs),
                name=f"fabric-rank-{local_rank}",
            )
            process.start()
            writer.close()
            processes.append(process)
            readers.append(reader)
        messages, failed_rank = _collect(processes, readers)
        errors = [(rank, text) for kind, rank, text in messages if kind == "error"]
        # Ranks that failed only because another rank's process ended are consequences; the cause is a rank that
        # failed by itself, or one that died without a word (a signal such as the OOM killer's SIGKILL, os._exit).
        causes = [(rank, text) for rank, text in errors if not peer_gone_text(text)]
        if not causes and failed_rank is not None and failed_rank not in dict(errors):
            code = describe_exit(processes[failed_rank].exitcode, oom_kills_before)
            others = f"; rank(s) {', '.join(str(rank) for rank, _ in errors)} failed after it" if errors else ""
            raise RankFailedError(f"Rank {failed_rank} of the launched job died with exit code {code}{others}.")
        if errors:
            first = (causes or errors)[0][0]
            details = "\n".join(f"--- rank {rank} ---\n{text}" for rank, text in errors)
            raise RankFailedError(f"Rank {first} of the launched job failed.\n{details}")
        return next((value for kind, _, value in messages if kind == "result"), None)

    def _rank_variables(self, local_rank: int) -> dict[str, str]:
        return rank_variables(
            main_address=self.cluster_environment.main_address,
            main_port=self.cluster_environment.main_port,
            world_size=self.num_processes,
            local_world_size=self.num_processes,
            local_rank=local_rank,
            global_rank=local_rank,
        )


def _run_rank(
    local_rank: int,
    variables: dict[str, str],
    channel: Connection,
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    os.environ.update(variables)
    try:
        value = function(*args, **kwargs)
        if local_rank == 0:
            channel.send(("result", 0, apply_to_collection(value, torch.Tensor, lambda t: t.detach().cpu())))
    except BaseException:
        channel.send(("error", local_rank, traceback.format_exc()))
        exit_process(1)
    exit_process(0, run_registered_cleanups=True)


def _collect(processes: list[Any], readers: list[Connection]) -> tuple[list[tuple[str, int, Any]], int | None]:
    """Read every rank's messages while the ranks run; on the first failure stop the others.

    Each channel is drained by its own thread, so a rank sending a large result never blocks on a full pipe
    while this process waits for the ranks to end.
    """
    messages: list[tuple[str, int, Any]] = []
    drains = [threading.Thread(target=_drain, args=(reader, messages), daemon=True) for reader in readers]
    for drain in drains:
        drain.start()
    ranks = {rank: SpawnedRank(process) for rank, process in enumerate(processes)}
    failed_rank = next((rank for rank, code in exits_in_order(ranks) if code != 0), None)
    if failed_rank is not None:
        stop_processes(ranks.values())
    for drain in drains:
        drain.join()
    return messages, failed_rank


def _drain(reader: Connection, messages: list[tuple[str, int, Any]]) -> None:
    with contextlib.suppress(EOFError):  # the rank ended and closed its end
        while True:
            messages.append(reader.recv())


class SpawnedRank:
    """A ``multiprocessing.Process`` behind the ``subprocess.Popen`` methods the shared supervision uses.

    Several threads wait on one rank (its waiter in ``exits_in_order``, ``stop_processes``). They wait on
    the process's sentinel, which does not reap it, and reap under a lock once it has ended: two threads
    reaping at once would leave the loser with no exit code.
    """

    def __init__(self, process: Any) -> None:
        self.process = process
        self._reaping = threading.Lock()

    def poll(self) -> int | None:
        with self._reaping:
            return self.process.exitcode  # type: ignore[no-any-return]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.kill(self.process.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        if not wait_for_ready([self.process.sentinel], timeout):
            raise subprocess.TimeoutExpired(self.process.name, timeout or 0.0)
        with self._reaping:
            self.process.join()  # it has ended, so this returns at once
            return self.process.exitcode  # type: ignore[no-any-return]

    def kill(self) -> None:
        if self.poll() is None:
            self.process.kill()
