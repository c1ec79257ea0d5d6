"""Pipeline parallelism through Fabric's loop on 2 real ranks (gloo), for tests/strategies/test_pipeline.py.

``python pipeline_job.py OUT SCHEDULE``: an ``nn.Sequential`` MLP cut after its second layer (with a multi-stage
schedule: into 4 stages, 2 per rank; with ``InterleavedZeroBubble-own-fsdp``: 2 stages that ``parallelize_fn`` shards
itself, under InterleavedZeroBubble; with ``ZBVZeroBubble-checkpointed``: ZBV recomputing the linear layers) trains 3
SGD steps with gradient clipping through
``ModelParallelStrategy(mesh=MeshPlan(pipeline_parallel=2), pipeline=PipelinePlan(...))``; then the loop's misuses are
tried and their messages kept. The model and batches are the reference's (pipeline_job_reference.py). Each rank writes
``OUT/rank-R.pt``: the losses it was returned, the clipped norms, its stage's weights, an evaluation's outputs and the
messages.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from pipeline_job_reference import MAX_NORM, STEPS, batches, make_model
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from fabric import Fabric
from fabric.strategies import MeshPlan, ModelParallelStrategy, PipelinePlan

MICROBATCHES = 4
#: The job that runs InterleavedZeroBubble on 2 stages that ``parallelize_fn`` shards itself.
OWN_FSDP = "InterleavedZeroBubble-own-fsdp"
#: The job that runs ZBVZeroBubble with every linear layer's activations recomputed in the backward (twice: the
#: inputs' gradients, then the weights').
CHECKPOINTED = "ZBVZeroBubble-checkpointed"
#: Where each schedule cuts the 5 layers: 2 stages, or 4 (rank 0 holds layers 0, 2 and 3, rank 1 layers 1 and 4;
#: in a V, rank 0 holds layers 0 and 4, rank 1 layers 1 to 3).
FOUR_STAGES = ["1", "2", "4"]
CUTS = {"1F1B": ["2"], "GPipe": ["2"], OWN_FSDP: ["2"]} | dict.fromkeys(
    ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV", CHECKPOINTED], FOUR_STAGES
)


def shard_each_stage(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """The user's own FSDP, freeing the gathered parameters after the forward (which a zero-bubble schedule's
    weight backward still needs: the strategy must keep them)."""
    fully_shard(model, mesh=mesh["data_parallel"], reshard_after_forward=True)
    return model


out_dir, job = Path(sys.argv[1]), sys.argv[2]
schedule = {OWN_FSDP: "InterleavedZeroBubble", CHECKPOINTED: "ZBVZeroBubble"}.get(job, job)
plan = PipelinePlan(CUTS[job], F.mse_loss, microbatches=MICROBATCHES, schedule=schedule)
strategy = ModelParallelStrategy(
    shard_each_stage if job == OWN_FSDP else None,
    mesh=MeshPlan(pipeline_parallel=2, data_parallel=1),
    pipeline=plan,
    activation_checkpointing={nn.Linear} if job == CHECKPOINTED else None,
)
fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
fabric.launch()
model = make_model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = fabric.setup(model, optimizer)
report: dict[str, object] = {"losses": [], "norms": [], "messages": {}}
for inputs, targets in batches()[:STEPS]:
    loss = model(inputs, target=targets)
    fabric.backward(loss)
    report["norms"].append(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM).item())  # type: ignore[attr-defined]
    optimizer.step()
    optimizer.zero_grad()
    report["losses"].append(loss.item())  # type: ignore[attr-defined]
report["weights"] = {name: value.full_tensor().detach() for name, value in model.module.state_dict().items()}
report["optimizer_parameters"] = sum(len(group["params"]) for group in optimizer.param_groups)
inputs, targets = batches()[3]
with torch.no_grad():
    report["eval_loss"] = model(inputs, target=targets).item()
    report["eval_output"] = model(inputs)
messages: dict[str, str] = report["messages"]  # type: ignore[assignment]
for name, misuse in {
    "no target": lambda: model(inputs),
    "uneven batch": lambda: model(inputs[:6], target=targets[:6]),
    "other tensor": lambda: fabric.backward((next(model.module.parameters()) ** 2).sum()),
    "huggingface": lambda: fabric.save(out_dir / "hf", {"model": model}, format="huggingface"),
}.items():
    try:
        misuse()
    except ValueError as error:
        messages[name] = str(error)
torch.save(report, out_dir / f"rank-{fabric.global_rank}.pt")
