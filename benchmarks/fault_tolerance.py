"""Fault tolerance on torchft (``strategy="fault_tolerant_ddp"``) against plain DDP and against restart + autoresume.

Every job trains the same MLP (``--dim``, 4 layers, batch 32 per process, SGD) for ``--steps`` steps on CPU, one
process per replica group, each job in fresh processes:

* **overhead**: the median step time of 2 replica groups of 1 process (Fabric, a torchft lighthouse) against plain
  torch DDP over the same 2 processes (``init_process_group("gloo")``, ``DistributedDataParallel``); with
  ``--group-size N`` 2 groups of N processes each (DDP inside a group) against plain DDP over the 2N; printed as
  ``overhead: R x`` (goal: at most 1.05x on CPU), and as ``cpu overhead: R x`` in CPU time per step (every thread of
  the process: torchft's quorum and heartbeats too), which a busy machine blurs less than the wall time. With
  ``--fsdp`` also ``strategy="fault_tolerant_fsdp"`` (2 groups of one FSDP2 shard each) against plain torch HSDP
  over the same 2 processes (``fully_shard`` on a 2 x N replicate x shard mesh), printed as ``overhead (fsdp): R x``.
  The peer, in the same rounds (groups of one process): torchft written directly as its own DDP example does it
  (``torchft.Manager``, its ``DistributedDataParallel``, whose comm hook all-reduces each bucket through the manager,
  and its ``OptimizerWrapper``: the quorum at ``zero_grad``, ``should_commit`` at ``step``), printed as
  ``overhead (raw torchft): R x`` against the same plain DDP: what torchft itself costs, beside what Fabric adds.
* **one failure**: 3 processes, of which one is SIGKILLed at step ``--kill-at``:
  - fault tolerant: 3 replica groups; the group killed does not come back, the 2 others finish the run.
    *Steps lost*: steps the survivors ran whose update was discarded. *Wall time lost*: the survivors' time for the
    run minus the same run without a failure.
  - restart: a 3-process Fabric DDP job under ``torchrun --max-restarts=1`` saving a checkpoint every
    ``--checkpoint-every`` steps; the restarted job loads the latest and trains to the end. *Steps lost*: the steps
    trained twice (from the checkpoint to the failure). *Wall time lost*: the job's time minus the same job without
    a failure.
  Printed as ``steps lost: N`` (the fault-tolerant run's) among the table.

The jobs run in a network namespace of their own when this runs as root (``unshare -n``): torchft's manager listens
on every interface. Usage::

    python benchmarks/fault_tolerance.py                   # 60 steps, dim 512, killed at step 35, checkpoints every 10
    python benchmarks/fault_tolerance.py --steps 100 --kill-at 55
    python benchmarks/fault_tolerance.py --rounds 5       # the overhead as the median of 5 alternating rounds
    python benchmarks/fault_tolerance.py --fsdp           # also fault_tolerant_fsdp against plain HSDP
    python benchmarks/fault_tolerance.py --group-size 2   # the overhead with groups of 2 processes (4 in all)
    python benchmarks/fault_tolerance.py --heartbeat-timeout-ms 5000   # `fabric lighthouse`'s default (500 here)

The survivors' wall time lost is mostly the lighthouse's heartbeat timeout: the quorum after a failure waits until
the dead group's heartbeats (every 100 ms) are that old. ``fabric lighthouse --heartbeat-timeout-ms`` sets it; a
shorter one finds a dead group sooner, and also takes a group whose heartbeats stall that long (an overloaded host)
for dead, which then takes part again from a later quorum (as docs/fault-tolerance.md says).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from job_results import print_result

RESULT_PREFIX = "FT_BENCH_RESULT "
IN_NAMESPACE = "FT_BENCH_IN_NAMESPACE"
BATCH, LAYERS, WARMUP = 32, 4, 5


def _model(dim: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(dim, dim), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(dim, 1))


def _batch(dim: int, step: int, share: int) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(1000 * step + share)
    inputs = torch.randn(BATCH, dim, generator=generator)
    return inputs, inputs.mean(dim=1, keepdim=True)


def _summary(times: list[float], cpu_times: list[float], started: float, extra: dict[str, Any]) -> dict[str, Any]:
    """The median step's wall and CPU time (ms, after the warm-up) and the job's wall time (s)."""
    return {
        "step_ms": statistics.median(times[WARMUP:]) * 1000,
        "cpu_ms": statistics.median(cpu_times[WARMUP:]) * 1000,
        "wall_s": time.perf_counter() - started,
        **extra,
    }


def job_ddp(args: argparse.Namespace) -> None:
    """Plain torch: DDP (or with ``--fsdp`` HSDP, one shard per replica) over the processes of the job, gloo."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    started = time.perf_counter()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = _model(args.dim)
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        shape = (2, dist.get_world_size() // 2)  # the replica groups' layout: 2 replicas of a group's shards
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        model = fully_shard(model, mesh=mesh)
    else:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    times, cpu_times = [], []
    for step in range(args.steps):
        begin, cpu_begin = time.perf_counter(), time.process_time()
        optimizer.zero_grad()
        inputs, targets = _batch(args.dim, step, rank)
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        times.append(time.perf_counter() - begin)
        cpu_times.append(time.process_time() - cpu_begin)
    if rank == 0:
        print_result(RESULT_PREFIX, _summary(times, cpu_times, started, {}))
    dist.destroy_process_group()


def job_fault_tolerant(args: argparse.Namespace) -> None:
    """A process of one replica group of ``--group-size`` (the variables name it), killing itself at ``--kill-at``
    if told."""
    import torch

    from fabric import Fabric

    started = time.perf_counter()
    strategy_name = "fault_tolerant_fsdp" if args.fsdp else "fault_tolerant_ddp"
    fabric = Fabric(accelerator="cpu", devices=args.group_size, strategy=strategy_name)
    fabric.launch()
    model = _model(args.dim)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    strategy = fabric.strategy
    group = strategy.fault_tolerance.replica_group
    share = group * args.group_size + fabric.global_rank
    times, cpu_times, lost = [], [], 0
    while (step := strategy.committed_steps) < args.steps:
        begin, cpu_begin = time.perf_counter(), time.process_time()
        optimizer.zero_grad()
        inputs, targets = _batch(args.dim, step, share)
        fabric.backward(torch.nn.functional.mse_loss(model(inputs), targets))
        if args.kill_at and step == args.kill_at and group == args.kill_group:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: the others are exchanging gradients with it
        optimizer.step()
        times.append(time.perf_counter() - begin)
        cpu_times.append(time.process_time() - cpu_begin)  # torchft's threads (quorum, heartbeats) included
        lost += strategy.committed_steps == step
    if fabric.global_rank == 0:
        print_result(RESULT_PREFIX, _summary(times, cpu_times, started, {"group": group, "steps_lost": lost}))


def job_torchft(args: argparse.Namespace) -> None:
    """torchft's data parallelism as its DDP example writes it, in a replica group of one process (the variables name
    it): the group's own store, a ``Manager``, torchft's ``DistributedDataParallel`` and ``OptimizerWrapper``."""
    from datetime import timedelta

    import torch
    import torchft
    from torch.distributed import TCPStore

    started = time.perf_counter()
    group, port = int(os.environ["FABRIC_FT_REPLICA_GROUP"]), int(os.environ["MASTER_PORT"])
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # torchrun's, under torchrun
    model = _model(args.dim)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def load(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timedelta(seconds=60)),
        load_state_dict=load,
        state_dict=lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
        min_replica_size=1,
        use_async_quorum=True,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=port,
        lighthouse_addr=f"http://{os.environ['TORCHFT_LIGHTHOUSE']}",
        replica_id=f"raw_torchft_{group}",
    )
    ddp = torchft.DistributedDataParallel(manager, model)
    wrapped = torchft.Optimizer(manager, optimizer)
    times, cpu_times, lost = [], [], 0
    while (step := manager.current_step()) < args.steps:
        begin, cpu_begin = time.perf_counter(), time.process_time()
        wrapped.zero_grad()
        inputs, targets = _batch(args.dim, step, group)
        torch.nn.functional.mse_loss(ddp(inputs), targets).backward()
        wrapped.step()
        times.append(time.perf_counter() - begin)
        cpu_times.append(time.process_time() - cpu_begin)
        lost += manager.current_step() == step
    print_result(RESULT_PREFIX, _summary(times, cpu_times, started, {"group": group, "steps_lost": lost}))
    manager.shutdown(wait=False)
    del store


def job_restart(args: argparse.Namespace) -> None:
    """Fabric DDP under torchrun: a checkpoint every ``--checkpoint-every`` steps, autoresume from the latest; rank
    ``--kill-group`` kills itself at ``--kill-at`` in the first attempt."""
    import torch

    from fabric import Fabric

    fabric = Fabric(accelerator="cpu", strategy="ddp")
    fabric.launch()
    model = _model(args.dim)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    checkpoint = Path(args.work) / "checkpoint.pt"
    if checkpoint.exists():
        fabric.load(checkpoint, state)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if fabric.global_rank == 0:
        (Path(args.work) / f"attempt-{attempt}").write_text(str(state["step"]))  # where it started
    while state["step"] < args.steps:
        step = state["step"]
        optimizer.zero_grad()
        inputs, targets = _batch(args.dim, step, fabric.global_rank)
        if args.kill_at and attempt == "0" and step == args.kill_at and fabric.global_rank == args.kill_group:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step, as in the fault-tolerant run
        fabric.backward(torch.nn.functional.mse_loss(model(inputs), targets))
        optimizer.step()
        state["step"] = step + 1
        if state["step"] % args.checkpoint_every == 0:
            fabric.save(checkpoint, state)


# --- the orchestrator ------------------------------------------------------------------------------------------------


def _own(args: argparse.Namespace, job: str, *extra: str, fsdp: bool = False, group_size: int = 1) -> list[str]:
    command = [sys.executable, __file__, "--job", job, "--steps", str(args.steps), "--dim", str(args.dim), *extra]
    command += ["--group-size", str(group_size)]
    return [*command, "--fsdp"] if fsdp else command


def _environment(**variables: str) -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**environment, "OMP_NUM_THREADS": "1", **variables}


def _run_ddp(args: argparse.Namespace, port: int, fsdp: bool = False) -> dict[str, Any]:
    world = 2 * args.group_size
    processes = [
        subprocess.Popen(
            _own(args, "ddp", fsdp=fsdp),
            env=_environment(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = [process.communicate(timeout=900)[0] for process in processes]
    return _result(outputs[0])


def _run_fault_tolerant(
    args: argparse.Namespace,
    groups: int,
    kill_at: int,
    fsdp: bool = False,
    group_size: int = 1,
    job: str = "fault_tolerant",
) -> list[dict[str, Any]]:
    """``groups`` replica groups of ``group_size`` processes (torchrun's variables in each, its own rendezvous)
    running ``job``."""
    from torchft.coordination import LighthouseServer

    timeout = args.heartbeat_timeout_ms
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=timeout, heartbeat_timeout_ms=timeout
    )
    address = f"127.0.0.1:{lighthouse.address().rpartition(':')[2]}"
    try:
        group_variables = {"WORLD_SIZE": str(group_size), "LOCAL_WORLD_SIZE": str(group_size), "GROUP_RANK": "0"}
        processes = [
            subprocess.Popen(
                _own(args, job, "--kill-at", str(kill_at), fsdp=fsdp, group_size=group_size),
                env=_environment(
                    FABRIC_FT_REPLICA_GROUP=str(group),
                    FABRIC_FT_REPLICA_GROUPS=str(groups),
                    TORCHFT_LIGHTHOUSE=address,
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(29700 + group),
                    **(group_variables | {"RANK": str(rank), "LOCAL_RANK": str(rank)} if group_size > 1 else {}),
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            for group in range(groups)
            for rank in range(group_size)
        ]
        outputs = [process.communicate(timeout=900)[0] for process in processes]
    finally:
        lighthouse.shutdown()
    return [_result(output) for output in outputs if RESULT_PREFIX in output]


def _run_restart(args: argparse.Namespace, kill_at: int, work: Path) -> dict[str, Any]:
    work.mkdir()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3", "--max-restarts=1",
        "--monitor-interval=0.1", "--master_port=29800", __file__, "--job", "restart", "--steps", str(args.steps),
        "--dim", str(args.dim), "--kill-at", str(kill_at), "--checkpoint-every", str(args.checkpoint_every),
        "--work", str(work),
    ]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, env=_environment(), capture_output=True, text=True, timeout=900, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"the restart job failed ({done.returncode}): {done.stderr[-2000:]}")
    restarted = work / "attempt-1"
    resumed_at = int(restarted.read_text()) if restarted.exists() else kill_at
    return {"wall_s": wall, "steps_lost": kill_at - resumed_at}  # trained in the first attempt, and again


def _result(output: str) -> dict[str, Any]:
    for line in output.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])  # type: ignore[no-any-return]
    raise RuntimeError(f"a job printed no result: {output[-2000:]}")


def _ratios(groups: list[dict[str, Any]], reference: dict[str, Any]) -> tuple[float, float]:
    """The groups' median step against the plain run's: in wall time and in CPU time."""
    return tuple(  # type: ignore[return-value]
        statistics.median(r[key] for r in groups) / reference[key] for key in ("step_ms", "cpu_ms")
    )


def _print_comparison(
    group_size: int,
    reference_label: str,
    reference: dict[str, Any],
    strategy: str,
    groups: list[dict[str, Any]],
    rounds: list[tuple[float, float]],
    overhead_label: str,
) -> None:
    """The plain run's row, each group's of the last round, the per-round ratios (wall time, CPU time) and their
    medians."""
    print(f"{reference_label:58} {reference['step_ms']:8.1f} {reference['cpu_ms']:7.1f} {reference['wall_s']:7.1f}")
    for r in groups:
        label = f"{strategy}, 2 groups of {group_size} (group {r['group']})"
        print(f"{label:58} {r['step_ms']:8.1f} {r['cpu_ms']:7.1f} {r['wall_s']:7.1f} {r['steps_lost']:10d}")
    walls, cpus = ([ratios[index] for ratios in rounds] for index in (0, 1))
    if len(rounds) > 1:
        print(f"(the last of {len(rounds)} rounds; overhead per round: {_listed(walls)})")
    print(f"{overhead_label}: {statistics.median(walls):.2f} x")
    print(f"cpu {overhead_label}: {statistics.median(cpus):.2f} x (CPU time per step, every thread of the process)")


def _listed(ratios: list[float]) -> str:
    return ", ".join(f"{r:.2f}" for r in ratios)


JOBS = {"ddp": job_ddp, "fault_tolerant": job_fault_tolerant, "torchft": job_torchft, "restart": job_restart}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", choices=tuple(JOBS))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--kill-at", type=int, default=35)
    parser.add_argument("--kill-group", type=int, default=2)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1, help="alternating DDP / fault-tolerant rounds (median)")
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=500,
        help="the lighthouse's heartbeat and join timeouts: how soon a dead group is left out of the quorum",
    )
    parser.add_argument("--fsdp", action="store_true", help="also measure fault_tolerant_fsdp against plain HSDP")
    parser.add_argument("--group-size", type=int, default=1, help="processes per replica group in the overhead runs")
    parser.add_argument("--work")
    args = parser.parse_args()
    if args.job is not None:
        JOBS[args.job](args)
        return
    if os.environ.get(IN_NAMESPACE) is None and os.geteuid() == 0 and shutil.which("unshare"):
        command = f"ip link set lo up && exec {sys.executable} {' '.join(map(str, sys.argv))}"
        os.execvpe("unshare", ["unshare", "-n", "sh", "-c", command], {**os.environ, IN_NAMESPACE: "1"})

    os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse's INFO lines, ten a second
    kill_at = args.kill_at
    # (wall, CPU) ratios per round, alternating, so that both see the same moments of a busy machine
    rounds: list[tuple[float, float]] = []
    fsdp_rounds: list[tuple[float, float]] = []
    raw_rounds: list[tuple[float, float]] = []
    raw = args.group_size == 1  # torchft's DDP wraps one process per group
    for _ in range(args.rounds):
        ddp = _run_ddp(args, 29600)
        fault_tolerant = _run_fault_tolerant(args, groups=2, kill_at=0, group_size=args.group_size)
        rounds.append(_ratios(fault_tolerant, ddp))
        if raw:
            raw_torchft = _run_fault_tolerant(args, groups=2, kill_at=0, job="torchft")
            raw_rounds.append(_ratios(raw_torchft, ddp))
        if args.fsdp:
            hsdp = _run_ddp(args, 29600, fsdp=True)
            fault_tolerant_fsdp = _run_fault_tolerant(args, groups=2, kill_at=0, fsdp=True, group_size=args.group_size)
            fsdp_rounds.append(_ratios(fault_tolerant_fsdp, hsdp))
    calm = _run_fault_tolerant(args, groups=3, kill_at=0)
    failed = _run_fault_tolerant(args, groups=3, kill_at=kill_at)
    with tempfile.TemporaryDirectory() as work:
        restart_calm = _run_restart(args, 0, Path(work) / "calm")
        restart_failed = _run_restart(args, kill_at, Path(work) / "failed")
    ft_wall_lost = max(r["wall_s"] for r in failed) - max(r["wall_s"] for r in calm)
    restart_wall_lost = restart_failed["wall_s"] - restart_calm["wall_s"]
    steps_lost = max(r["steps_lost"] for r in failed)
    print(
        f"MLP dim {args.dim} x {LAYERS} layers, batch {BATCH}/process, {args.steps} steps, CPU (gloo); lighthouse "
        f"heartbeat and join timeouts {args.heartbeat_timeout_ms} ms"
    )
    print(f"{'job':58} {'step ms':>8} {'cpu ms':>7} {'wall s':>7} {'steps lost':>10}")
    world, size = 2 * args.group_size, args.group_size
    _print_comparison(
        size, f"plain torch DDP, {world} processes", ddp, "fault_tolerant_ddp", fault_tolerant, rounds, "overhead"
    )
    if raw:
        print(f"(raw torchft against the same plain DDP: {len(raw_rounds)} rounds)")
        for r in raw_torchft:
            label = f"raw torchft (its DDP and optimizer wrapper), group {r['group']}"
            print(f"{label:58} {r['step_ms']:8.1f} {r['cpu_ms']:7.1f} {r['wall_s']:7.1f} {r['steps_lost']:10d}")
        walls, cpus = ([ratios[index] for ratios in raw_rounds] for index in (0, 1))
        print(f"overhead (raw torchft): {statistics.median(walls):.2f} x (per round: {_listed(walls)})")
        print(f"cpu overhead (raw torchft): {statistics.median(cpus):.2f} x")
    if args.fsdp:
        reference = f"plain torch HSDP (2 replicas x {size} shards), {world} processes"
        _print_comparison(
            size, reference, hsdp, "fault_tolerant_fsdp", fault_tolerant_fsdp, fsdp_rounds, "overhead (fsdp)"
        )
    label = f"fault_tolerant_ddp, 3 groups, group 2 SIGKILLed at step {kill_at}"
    print(f"{label:58} {'':8} {'':7} {max(r['wall_s'] for r in failed):7.1f} {steps_lost:10d}")
    label = f"torchrun --max-restarts=1 + autoresume (every {args.checkpoint_every}), rank 2 killed"
    print(f"{label:58} {'':8} {'':7} {restart_failed['wall_s']:7.1f} {restart_failed['steps_lost']:10d}")
    print(f"steps lost: {steps_lost}")
    print(
        f"wall time lost to the failure: fault tolerant {ft_wall_lost:.1f} s, restart + autoresume "
        f"{restart_wall_lost:.1f} s ({ft_wall_lost / restart_wall_lost:.0%} of the restart's)"
    )


if __name__ == "__main__":
    main()
