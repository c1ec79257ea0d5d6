"""Step time and peak memory per rank of each mesh shape through Fabric, against the same mesh in torch's own APIs.

For each shape (``REPLICATE x SHARD x TENSOR``, or ``ppPIPELINE x REPLICATE x SHARD x TENSOR``; ``ppPgpipe...``: the
GPipe schedule instead of 1F1B, ``ppPv2...``: 2 stages interleaved on each pipeline rank, ``ppPzbv...``: 2 in a V
under ZBVZeroBubble; ``trainer-...``: the Trainer instead of a Fabric loop) two jobs run on as many CPU ranks (gloo) as
the degrees multiply to (4, or 8 for ``2x4x1`` and ``2x2x2``), one after the other, each in its own processes, both
started by ``torchrun`` (``--job fabric|trainer|raw --shape SHAPE``), so that only the strategy differs:

* **fabric**: ``FSDPStrategy(mesh=MeshPlan(...), shard_modules={Block})``, or with a tensor-parallel or pipeline degree
  ``ModelParallelStrategy(parallelize, mesh=MeshPlan(...), shard_modules={Block}, pipeline=PipelinePlan(...))``;
  ``fabric.setup``, ``fabric.backward``; with a pipeline ``loss = model(inputs, target=targets)`` (the loss also sent
  to every stage, which the raw job does not do);
* **trainer**: ``Trainer(parallelism_config={"fsdp": {"data_parallel_replicate_degree": R,
  "data_parallel_shard_degree": S}, "tp": {"tensor_parallel_degree": T, "layer_plan": {...}}})``, the blocks marked
  ``_fsdp_wrap`` as in Composer, the raw job's tensor-parallel plan as the ``layer_plan``, a ``DataLoader`` of the
  global batch's share; a step is timed from BATCH_START to BATCH_END (the ranks lined up before it, as in the loops),
  so it includes what the Trainer does per batch (the loss averaged over the ranks, the clock, the events);
* **raw**: ``init_process_group``, ``init_device_mesh`` with the dimensions the shape needs, the stage's blocks kept
  by hand (torchtitan's way: with several stages per rank, a deep copy of the model per stage), ``parallelize_module``
  with the same plan, ``fully_shard`` on each block and each stage's root, ``PipelineStage`` and ``Schedule1F1B`` (2
  microbatches, or one per pipeline rank; ``ScheduleGPipe``; ``ScheduleInterleaved1F1B`` or ``ScheduleZBVZeroBubble``,
  its blocks and roots not resharded after the forward as Fabric does under it, with 2 stages per rank),
  ``loss.backward()`` without a pipeline.

The model is a causal transformer (``--dim``, ``--layers``, 4 heads, sequences of ``--length``), AdamW, a global
batch of 8 split over the data-parallel ranks. Per job: **step ms**, the median wall time of a step after 5 warm-up
steps on the slowest rank; **cpu ms**, the median CPU time of a step (``time.process_time``, every thread of the
process) summed over the ranks: the work done, which a 2-core machine running 4 ranks does not blur with whose turn
it was; **max RSS MB**, the peak resident memory of the largest rank. Each line ends with the
time ratio ``fabric / raw`` (goal: within 1.02x). Usage::

    python benchmarks/parallelism.py                        # dim 256, 4 layers, length 128, 30 steps
    python benchmarks/parallelism.py --rounds 3             # alternate fabric/raw 3 times, medians of the rounds
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import sys
import time
from typing import Any

from job_results import print_result, run_for_result

SHAPES = (
    "2x2x1",
    "4x1x1",
    "1x4x1",
    "1x2x2",
    "2x1x2",
    "pp2x1x2x1",
    "pp2x1x1x2",
    "pp4x1x1x1",
    "pp4gpipex1x1x1",
    "pp2v2x1x2x1",
    "pp2zbvx1x2x1",
    "trainer-2x2x1",
    "trainer-1x2x2",
    "2x4x1",
    "2x2x2",
)
RESULT_PREFIX = "PARALLELISM_RESULT "
#: A shape run through the Trainer (``parallelism_config``) instead of a Fabric loop.
TRAINER_PREFIX = "trainer-"
WARMUP, HEADS, VOCAB, GLOBAL_BATCH = 5, 4, 512, 8


def _model(dim: int, layers: int) -> tuple[Any, type]:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
            self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x: torch.Tensor) -> Any:
            batch, length, _ = x.shape
            h = self.norm1(x)
            q, k, v = (p(h).view(batch, length, -1, dim // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
            attended = (
                F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, length, -1)
            )
            x = x + self.o(attended)
            return x + self.down(F.gelu(self.up(self.norm2(x))))

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(VOCAB, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.head = nn.Linear(dim, VOCAB)

        def forward(self, tokens: torch.Tensor) -> Any:
            x = self.embedding(tokens) if self.embedding is not None else tokens  # None: another pipeline stage's
            for block in self.blocks:
                x = block(x)
            return self.head(x) if self.head is not None else x

    torch.manual_seed(0)
    return Transformer(), Block


def _parallelize(model: Any, mesh: Any) -> Any:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
    plan |= {"up": ColwiseParallel(), "down": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, mesh["tensor_parallel"], plan)
    return model


#: The pipeline variants of a shape (``pp2v2x...``): torch's schedule for each, and the stages each rank holds.
PIPELINE_SCHEDULES = {"": ("1F1B", 1), "gpipe": ("GPipe", 1), "v2": ("Interleaved1F1B", 2), "zbv": ("ZBVZeroBubble", 2)}


def _world(shape: str) -> int:
    """The ranks a shape takes: the product of its degrees."""
    pipeline, _, replicate, shard, tensor = _degrees(shape)
    return pipeline * replicate * shard * tensor


def _degrees(shape: str) -> tuple[int, str, int, int, int]:
    """``RxSxT``, ``ppPxRxSxT`` or ``ppP<variant>xRxSxT`` (``trainer-`` before any) as (pipeline, variant, replicate,
    shard, tensor)."""
    shape = shape.removeprefix(TRAINER_PREFIX)
    if not shape.startswith("pp"):
        replicate, shard, tensor = (int(part) for part in shape.split("x"))
        return 1, "", replicate, shard, tensor
    pipeline, *rest = shape.removeprefix("pp").split("x")
    variant = pipeline.lstrip("0123456789")
    if variant not in PIPELINE_SCHEDULES:
        raise SystemExit(f"shape {shape!r}: the pipeline variant {variant!r} is not one of {list(PIPELINE_SCHEDULES)}")
    replicate, shard, tensor = (int(part) for part in rest)
    return int(pipeline.removesuffix(variant)), variant, replicate, shard, tensor


def _keep_stage_by_hand(model: Any, stage: int, stages: int) -> None:
    """The raw job's cut (torchtitan's): this stage's share of the blocks, the embedding first, the head last."""
    per_stage = len(model.blocks) // stages
    for index in range(len(model.blocks)):
        if index // per_stage != stage:
            del model.blocks._modules[str(index)]
    if stage != 0:
        model.embedding = None
    if stage != stages - 1:
        model.head = None


def _loss(logits: Any, targets: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def run_job(kind: str, shape: str, args: argparse.Namespace) -> None:
    """One rank of the job; rank 0 prints the result line."""
    import torch
    import torch.distributed as dist

    pipeline, variant, replicate, shard, tensor = _degrees(shape)
    world = _world(shape)
    schedule_name, per_rank = PIPELINE_SCHEDULES[variant]
    stages, microbatches = pipeline * per_rank, max(2, pipeline)
    zero_bubble = schedule_name == "ZBVZeroBubble"  # its weight backward needs the parameters gathered
    model, block_class = _model(args.dim, args.layers)
    step: Any
    barrier: Any
    if kind == "fabric":
        from fabric import Fabric
        from fabric.strategies import FSDPStrategy, MeshPlan, ModelParallelStrategy, PipelinePlan

        plan = MeshPlan(
            pipeline_parallel=pipeline, data_parallel_replicate=replicate, data_parallel=shard, tensor_parallel=tensor
        )
        strategy: Any
        if pipeline == 1 and tensor == 1:
            strategy = FSDPStrategy(mesh=plan, shard_modules={block_class})
        else:
            per_stage = args.layers // stages
            split_points = [f"blocks.{per_stage * stage}" for stage in range(1, stages)]
            parallelize = _parallelize if tensor > 1 else None
            pipelined = {}
            if pipeline > 1:
                pipelined["pipeline"] = PipelinePlan(split_points, _loss, microbatches, schedule=schedule_name)
            strategy = ModelParallelStrategy(parallelize, mesh=plan, shard_modules={block_class}, **pipelined)
        fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
        fabric.launch()
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        data_rank = fabric.strategy.data_parallel_shard[1]  # type: ignore[attr-defined]
        barrier = fabric.barrier

        def step(inputs: Any, targets: Any) -> None:
            loss = model(inputs, target=targets) if pipeline > 1 else _loss(model(inputs), targets)
            fabric.backward(loss)

    elif kind == "trainer":
        _run_trainer(model, block_class, replicate, shard, tensor, world, args)
        return
    else:
        from torch.distributed import pipelining
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage

        dist.init_process_group("gloo")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # as Fabric shares the cores
        mesh = init_device_mesh(
            "cpu",
            (pipeline, replicate, shard, tensor),
            mesh_dim_names=("pipeline", "replicate", "data_parallel", "tensor_parallel"),
        )
        stage = mesh["pipeline"].get_local_rank()  # the pipeline rank
        local_stages = [stage, stages - 1 - stage] if zero_bubble else list(range(stage, stages, pipeline))
        parts = [model] if per_rank == 1 else [copy.deepcopy(model) for _ in local_stages]
        data_mesh = mesh["replicate", "data_parallel"] if replicate > 1 else mesh["data_parallel"]
        for part, index in zip(parts, local_stages, strict=True):
            if pipeline > 1:
                _keep_stage_by_hand(part, index, stages)
            if tensor > 1:
                _parallelize(part, mesh)
            for block in part.blocks:
                fully_shard(block, mesh=data_mesh, reshard_after_forward=not zero_bubble)
            fully_shard(part, mesh=data_mesh, reshard_after_forward=not zero_bubble)
        optimizer = torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=1e-4)
        data_rank = (dist.get_rank() // tensor) % (replicate * shard)
        barrier = dist.barrier
        if pipeline > 1:
            device, group = torch.device("cpu"), mesh["pipeline"].get_group()
            pipe_stages = [
                PipelineStage(part, index, stages, device, group=group)
                for part, index in zip(parts, local_stages, strict=True)
            ]
            schedule_class = getattr(pipelining, f"Schedule{schedule_name}")
            schedule: Any = schedule_class(
                pipe_stages if per_rank > 1 else pipe_stages[0], n_microbatches=microbatches, loss_fn=_loss
            )

        def step(inputs: Any, targets: Any) -> None:
            if pipeline == 1:
                _loss(model(inputs), targets).backward()
            else:
                first, last = 0 in local_stages, stages - 1 in local_stages
                schedule.step(*([inputs] if first else []), target=targets if last else None, losses=[])

    local_batch = GLOBAL_BATCH // (replicate * shard)
    generator = torch.Generator().manual_seed(data_rank)
    tokens = torch.randint(0, VOCAB, (local_batch, args.length + 1), generator=generator)
    timer = StepTimer(barrier)
    for _ in range(args.steps):
        timer.start()
        optimizer.zero_grad()
        step(tokens[:, :-1], tokens[:, 1:])
        optimizer.step()
        timer.stop()
    timer.report()
    if kind == "raw":
        dist.destroy_process_group()


class StepTimer:
    """Each step's wall and CPU time, the ranks lined up by ``barrier`` before it; rank 0 prints the result line."""

    def __init__(self, barrier: Any) -> None:
        self.barrier = barrier
        self.times: list[float] = []
        self.cpu_times: list[float] = []

    def start(self) -> None:
        self.barrier()
        self._start, self._cpu_start = time.perf_counter(), time.process_time()

    def stop(self) -> None:
        self.times.append(time.perf_counter() - self._start)
        self.cpu_times.append(time.process_time() - self._cpu_start)

    def report(self) -> None:
        """The median step after the warm-up on the slowest rank, CPU time summed over the ranks, the largest RSS."""
        import torch
        import torch.distributed as dist

        step_time = torch.tensor(statistics.median(self.times[WARMUP:]))
        cpu_time = torch.tensor(statistics.median(self.cpu_times[WARMUP:]))
        rss = torch.tensor(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # kB on Linux
        dist.all_reduce(step_time, op=dist.ReduceOp.MAX)
        dist.all_reduce(cpu_time, op=dist.ReduceOp.SUM)
        dist.all_reduce(rss, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            result = {"step_ms": step_time.item() * 1e3, "cpu_ms": cpu_time.item() * 1e3, "rss_mb": rss.item()}
            print_result(RESULT_PREFIX, result)


def _run_trainer(
    network: Any, block_class: type, replicate: int, shard: int, tensor: int, world: int, args: argparse.Namespace
) -> None:
    """The shape through the Trainer: Composer's ``parallelism_config`` (the blocks FSDP units by ``_fsdp_wrap``, the
    raw job's tensor-parallel plan as a ``layer_plan``), each batch timed from BATCH_START to BATCH_END."""
    import torch
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torch.utils.data import DataLoader

    from fabric.trainer import Callback, Trainer

    class LanguageModel(nn.Module):
        """The transformer behind the Trainer's model interface (``forward(batch)``, ``loss(outputs, batch)``)."""

        def __init__(self) -> None:
            super().__init__()
            self.network = network

        def forward(self, batch: Any) -> Any:
            return self.network(batch[:, :-1])

        def loss(self, outputs: Any, batch: Any) -> Any:
            return _loss(outputs, batch[:, 1:])

    class Timed(Callback):
        def __init__(self) -> None:
            self.timer = StepTimer(lambda: None)

        def batch_start(self, state: Any, logger: Any) -> None:
            self.timer.start()

        def batch_end(self, state: Any, logger: Any) -> None:
            self.timer.stop()

    block_class._fsdp_wrap = True  # type: ignore[attr-defined]  # Composer's way to name the FSDP units
    degrees = {"data_parallel_replicate_degree": replicate, "data_parallel_shard_degree": shard}
    config: dict[str, Any] = {"fsdp": degrees}
    if tensor > 1:
        styles = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
        styles |= {"up": ColwiseParallel(), "down": RowwiseParallel()}
        layer_plan = {f"network.blocks.*.{name}": style for name, style in styles.items()}
        config["tp"] = {"tensor_parallel_degree": tensor, "layer_plan": layer_plan}
    tokens = torch.randint(0, VOCAB, (args.steps * GLOBAL_BATCH, args.length + 1), generator=torch.Generator())
    model, timed = LanguageModel(), Timed()
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(tokens, batch_size=GLOBAL_BATCH // (replicate * shard)),
        max_duration=f"{args.steps}ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-4),
        parallelism_config=config,
        callbacks=[timed],
        progress_bar=False,
        accelerator="cpu",
        devices=world,
    )
    timed.timer.barrier = trainer.fabric.barrier
    trainer.fit()
    timed.timer.report()


def _measure(kind: str, shape: str, args: argparse.Namespace) -> dict[str, float]:
    # both under torchrun, so the launcher is the same and only the strategy differs (Fabric joins torchrun's world)
    world = _world(shape)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", __file__]
    command += ["--job", kind, "--shape", shape, "--dim", str(args.dim), "--layers", str(args.layers)]
    command += ["--length", str(args.length), "--steps", str(args.steps)]
    env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world)), **os.environ}
    result = run_for_result(command, RESULT_PREFIX, env=env)
    if isinstance(result, str):
        raise RuntimeError(f"{kind} {shape} {result}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--shapes",
        default=",".join(SHAPES),
        help="comma-separated RxSxT, ppPxRxSxT or ppP<variant>xRxSxT shapes, trainer- before one for the Trainer",
    )
    parser.add_argument("--job", choices=("fabric", "trainer", "raw"), help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        run_job(args.job, args.shape, args)
        return
    print(
        f"causal transformer dim {args.dim}, {args.layers} layers, length {args.length}, global batch {GLOBAL_BATCH}, "
        f"AdamW, as many CPU ranks (gloo) as the shape's degrees multiply to, {args.rounds} round(s)"
    )
    print(
        f"{'shape':<16}{'raw ms':>9}{'fabric ms':>11}{'raw cpu':>9}{'fabric cpu':>12}{'cpu ratio':>11}{'raw MB':>8}"
        f"{'fabric MB':>11}{'MB ratio':>10}  time ratio"
    )
    for shape in args.shapes.split(","):
        runs: dict[str, list[dict[str, float]]] = {"raw": [], "fabric": []}
        ours_kind = "trainer" if shape.startswith(TRAINER_PREFIX) else "fabric"
        for _ in range(args.rounds):
            runs["raw"].append(_measure("raw", shape, args))
            runs["fabric"].append(_measure(ours_kind, shape, args))
        raw, ours = (
            {key: statistics.median(run[key] for run in runs[kind]) for key in ("step_ms", "cpu_ms", "rss_mb")}
            for kind in ("raw", "fabric")
        )
        print(
            f"{shape:<16}{raw['step_ms']:>9.1f}{ours['step_ms']:>11.1f}{raw['cpu_ms']:>9.1f}{ours['cpu_ms']:>12.1f}"
            f"{ours['cpu_ms'] / raw['cpu_ms']:>10.2f}x{raw['rss_mb']:>8.0f}{ours['rss_mb']:>11.0f}"
            f"{ours['rss_mb'] / raw['rss_mb']:>9.2f}x  {ours['step_ms'] / raw['step_ms']:.2f}x"
        )


if __name__ == "__main__":
    main()
