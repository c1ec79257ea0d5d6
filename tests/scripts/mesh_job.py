"""A small causal transformer trained on an N-D mesh, for tests/strategies/test_mesh_shapes.py.

``python mesh_job.py OUT reference``: one plain-torch process trains ``STEPS + EXTRA`` steps on the whole global batch
of each step and writes ``OUT/reference.pt`` (the loss of every step, the weights after ``STEPS`` and at the end).

``python mesh_job.py OUT trainer REPLICATE SHARD TENSOR``: the same ``STEPS`` through Composer's ``Trainer`` with
``parallelism_config`` (the degrees, and a ``tp`` section with the same layer plan); writes ``OUT/trainer-TAG.pt``.

``python mesh_job.py OUT trainer-pp PIPELINE SHARD TENSOR``: the same ``STEPS`` through the Trainer on pipeline
stages (the model's network cut as ``CUTS`` says), FSDP over SHARD and TP over TENSOR, given as ``parallelism_config``
with a ``pp`` section (TENSOR 1) or as ``strategy=ModelParallelStrategy(..., pipeline=PipelinePlan(...))``; it also
evaluates ``EVAL_SAMPLES`` samples in batches of 4 (a ragged last one) and writes ``OUT/trainer-TAG.pt``.

``python mesh_job.py OUT trainer-resume LOAD_DIR``: one process continues the Trainer's checkpoint LOAD_DIR (saved by
``trainer-pp`` after ``STEPS`` batches) to ``STEPS + EXTRA`` batches; writes ``OUT/trainer-resumed.pt``.

``python mesh_job.py OUT train PIPELINE REPLICATE SHARD TENSOR [LOAD_DIR]``: ``PIPELINE x REPLICATE x SHARD x TENSOR``
processes (pipeline stages x HSDP x TP through ``ModelParallelStrategy(mesh=MeshPlan(...),
pipeline=PipelinePlan(...))``; ``PIPELINE`` as ``N`` and a variant of ``CUTS``, e.g. ``2v2``: 2 ranks of 2 interleaved
stages each; or ``FSDPStrategy(mesh=...)`` when PIPELINE and TENSOR are 1, or with PIPELINE ``1lightning`` Lightning's
front end ``FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(REPLICATE, SHARD), auto_wrap_policy={Block})``,
TAG ``lightning-REPLICATExSHARDx1``) train ``STEPS`` steps from batches of ``setup_dataloaders`` and save
``OUT/ckpt-TAG``. Given LOAD_DIR (saved on another shape), a fresh model loads it and
trains ``EXTRA`` steps more. Rank 0 writes ``OUT/TAG.pt``: losses and full weights (of every stage).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

VOCAB, DIM, HEADS, LENGTH, LAYERS = 32, 16, 4, 9, 2
GLOBAL_BATCH, STEPS, EXTRA, LR = 8, 3, 2, 1e-2
EVAL_SAMPLES = 10


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(3))
        # no key bias: softmax ignores it, so its gradient is rounding noise, which Adam scales up to lr-sized steps
        self.k = nn.Linear(DIM, DIM, bias=False)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        h = self.norm1(x)
        # -1 heads: under tensor parallelism each rank holds HEADS / TENSOR of them
        q, k, v = (part(h).view(batch, length, -1, DIM // HEADS).transpose(1, 2) for part in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, length, -1)
        x = x + self.o(attended)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # a part is None on the ranks of other pipeline stages (torchtitan's convention)
        x = self.embedding(tokens) if self.embedding is not None else tokens
        for block in self.blocks:
            x = block(x)
        x = self.norm(x) if self.norm is not None else x
        return self.head(x) if self.head is not None else x


def make_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer()


def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Megatron-style plan: q, k, v and up split by columns, o and down by rows; the rest stays whole."""
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
    plan |= {"up": ColwiseParallel(), "down": RowwiseParallel()}
    for block in model.blocks:  # type: ignore[union-attr]
        parallelize_module(block, mesh["tensor_parallel"], plan)
    return model


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH * (STEPS + EXTRA), LENGTH), generator=torch.Generator().manual_seed(1))
eval_tokens = torch.randint(0, VOCAB, (EVAL_SAMPLES, LENGTH), generator=torch.Generator().manual_seed(2))
out_dir, mode = Path(sys.argv[1]), sys.argv[2]

if mode == "reference":
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, after_steps = [], {}
    for step in range(STEPS + EXTRA):
        loss = loss_of(model, tokens[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step + 1 == STEPS:
            after_steps = full_weights(model)
            with torch.no_grad():
                eval_loss = loss_of(model, eval_tokens).item()
    report = {"losses": losses, "weights": after_steps, "final": full_weights(model), "eval_loss": eval_loss}
    torch.save(report, out_dir / "reference.pt")
    sys.exit(0)

from fabric import Fabric  # noqa: E402
from fabric.strategies import FSDPStrategy, MeshPlan, ModelParallelStrategy, PipelinePlan  # noqa: E402

variant = ""  # after the pipeline degree: how its stages are placed and scheduled (CUTS)
if mode == "trainer":
    pipeline, (replicate, shard, tensor) = 1, (int(value) for value in sys.argv[3:6])
    load_dir = None
elif mode == "trainer-pp":
    degree, variant = re.fullmatch(r"(\d+)(.*)", sys.argv[3]).groups()  # type: ignore[union-attr]
    (pipeline, shard, tensor), replicate = (int(degree), *(int(value) for value in sys.argv[4:6])), 1
    load_dir = None
elif mode == "trainer-resume":
    pipeline, replicate, shard, tensor = 1, 1, 1, 1
    load_dir = sys.argv[3]
else:
    degree, variant = re.fullmatch(r"(\d+)(.*)", sys.argv[3]).groups()  # type: ignore[union-attr]
    pipeline, (replicate, shard, tensor) = int(degree), (int(value) for value in sys.argv[4:7])
    load_dir = sys.argv[7] if len(sys.argv) > 7 else None
tag = f"{replicate}x{shard}x{tensor}"
if pipeline > 1:
    tag = f"pp{pipeline}{variant}x{tag}"
elif variant:  # a front end of the same mesh (LIGHTNING)
    tag = f"{variant}-{tag}"
loader_batch = GLOBAL_BATCH // (replicate * shard)
#: The variant of a PIPELINE of 1 that builds the HSDP mesh through Lightning's FSDPStrategy arguments.
LIGHTNING = "lightning"
#: Where each (pipeline degree, variant) cuts the model, its schedule and microbatches (``None``: 2, or one per stage
#: beyond). Variant ``v2`` interleaves 2 stages per rank: rank 0 holds the embedding and block 1, rank 1 block 0, the
#: norm and the head; ``zbv`` and ``dpv`` place them in a V (rank 0: the embedding and the norm with the head; rank 1
#: both blocks) under the zero-bubble schedules ZBV and DualPipeV (at least one microbatch per stage).
FOUR_STAGES = ["blocks.0", "blocks.1", "norm"]
CUTS: dict[tuple[int, str], tuple[list[str], str, int | None]] = {
    (2, ""): (["blocks.1"], "1F1B", None),
    (4, ""): (FOUR_STAGES, "GPipe", None),
    (2, "v2"): (FOUR_STAGES, "Interleaved1F1B", None),
    (2, "zbv"): (FOUR_STAGES, "ZBVZeroBubble", None),
    (2, "dpv"): (FOUR_STAGES, "DualPipeV", 4),
}


def fit_trainer(model: nn.Module, batch_size: int, batches: int, **options: object) -> Any:
    """The Trainer fitted on CPU for ``batches`` batches of ``batch_size`` of the train tokens, with AdamW."""
    from fabric.trainer import Trainer

    loader = DataLoader(TensorDataset(tokens), batch_size=batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    trainer = Trainer(
        model=model,
        train_dataloader=loader,
        max_duration=f"{batches}ba",
        optimizers=optimizer,
        accelerator="cpu",
        progress_bar=False,
        **options,  # type: ignore[arg-type]
    )
    trainer.fit()
    return trainer


if mode == "trainer":  # Composer's Trainer with parallelism_config describing the same mesh

    class ComposerTransformer(Transformer):
        def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
            return super().forward(batch[0][:, :-1])

        def loss(self, logits: torch.Tensor, batch: list[torch.Tensor]) -> torch.Tensor:
            return F.cross_entropy(logits.reshape(-1, VOCAB), batch[0][:, 1:].reshape(-1))

    torch.manual_seed(0)
    composer_model = ComposerTransformer()
    styles = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
    styles |= {"up": ColwiseParallel(), "down": RowwiseParallel()}
    fsdp = {"data_parallel_replicate_degree": replicate, "data_parallel_shard_degree": shard}
    config: dict[str, object] = {"fsdp": fsdp | {"state_dict_type": "sharded"}}
    if tensor > 1:
        config["tp"] = {"tensor_parallel_degree": tensor, "layer_plan": {f"blocks.*.{n}": s for n, s in styles.items()}}
    trainer = fit_trainer(
        composer_model, loader_batch, STEPS, parallelism_config=config, devices=replicate * shard * tensor
    )
    trained = trainer.state.model
    weights = full_weights(getattr(trained, "module", trained))
    strategy_name = type(trainer.fabric.strategy).__name__
    if trainer.fabric.is_global_zero:
        clock = trainer.state.timestamp.state_dict()
        torch.save({"weights": weights, "strategy": strategy_name, "timestamp": clock}, out_dir / f"trainer-{tag}.pt")
    sys.exit(0)

if mode in ("trainer-pp", "trainer-resume"):  # the Trainer on pipeline stages of a model whose network is a Transformer
    from fabric.trainer import ComposerModel

    class GPT(ComposerModel):
        def __init__(self) -> None:
            super().__init__()
            self.model = Transformer()  # the network the pipeline cuts

        def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
            return self.model(batch[0][:, :-1])  # type: ignore[no-any-return]

        def loss(self, logits: torch.Tensor, batch: list[torch.Tensor]) -> torch.Tensor:
            return next_token_loss(logits, batch[0][:, 1:])

        def get_metrics(self, is_train: bool = False) -> dict[str, object]:
            return {"cross_entropy": self.loss}

    torch.manual_seed(0)
    gpt = GPT()
    if mode == "trainer-resume":  # one process continues the checkpoint a pipeline's Trainer saved, to the end
        torch.manual_seed(123)
        gpt = GPT()  # other initial weights: all must come from the checkpoint
        trainer = fit_trainer(gpt, GLOBAL_BATCH, STEPS + EXTRA, load_path=load_dir, devices=1)
        clock = trainer.state.timestamp.state_dict()
        torch.save({"final": full_weights(gpt.model), "timestamp": clock}, out_dir / "trainer-resumed.pt")
        sys.exit(0)
    split_points, schedule, microbatches = CUTS[pipeline, variant]
    points = [f"model.{point}" for point in split_points]
    microbatches = microbatches or 2
    pp_section = {
        "pipeline_parallel_degree": pipeline,
        "split_points": points,
        "microbatches": microbatches,
        "schedule": schedule,
    }
    choices: dict[str, object]
    if tensor == 1:
        fsdp = {"data_parallel_shard_degree": shard}
        choices = {"parallelism_config": {"fsdp": fsdp, "pp": pp_section}}
    else:
        stages = PipelinePlan(points, microbatches=microbatches, schedule=schedule)
        mesh = MeshPlan(pipeline_parallel=pipeline, data_parallel=shard, tensor_parallel=tensor)

        def parallelize_network(model: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            parallelize(model.model, device_mesh)  # type: ignore[arg-type]
            return model

        choices = {"strategy": ModelParallelStrategy(parallelize_network, mesh=mesh, pipeline=stages)}
    trainer = fit_trainer(
        gpt,
        loader_batch,
        STEPS,
        eval_dataloader=DataLoader(TensorDataset(eval_tokens), batch_size=4),
        devices=pipeline * shard * tensor,
        save_folder=str(out_dir / f"trainer-ckpt-{tag}"),
        save_interval=f"{STEPS}ba",
        save_filename="ba{batch}",
        **choices,
    )
    stage_weights = full_weights(gpt.model)
    loss_over_ranks = trainer.fabric.all_reduce(trainer.state.loss, reduce_op="mean").item()  # each rank's share's
    gathered: list[dict[str, torch.Tensor]] = [{} for _ in range(trainer.fabric.world_size)]
    torch.distributed.all_gather_object(gathered, stage_weights)
    if trainer.fabric.is_global_zero:
        report = {
            "weights": {name: value for stage in gathered for name, value in stage.items()},
            "strategy": type(trainer.fabric.strategy).__name__,
            "timestamp": trainer.state.timestamp.state_dict(),
            "loss": loss_over_ranks,
            "metrics": {name: float(value) for name, value in trainer.state.metrics.items()},
        }
        torch.save(report, out_dir / f"trainer-{tag}.pt")
    sys.exit(0)

plan = MeshPlan(
    pipeline_parallel=pipeline, data_parallel_replicate=replicate, data_parallel=shard, tensor_parallel=tensor
)
strategy: FSDPStrategy
if pipeline > 1:
    split_points, schedule, microbatches = CUTS[pipeline, variant]
    microbatches = microbatches or max(2, pipeline)
    stages = PipelinePlan(split_points, next_token_loss, microbatches=microbatches, schedule=schedule)
    strategy = ModelParallelStrategy(parallelize if tensor > 1 else None, mesh=plan, pipeline=stages)
elif tensor > 1:
    strategy = ModelParallelStrategy(parallelize, mesh=plan)
elif variant == LIGHTNING:  # Lightning's HSDP front end: the sizes of the (replicate, shard) device mesh
    strategy = FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(replicate, shard), auto_wrap_policy={Block})
else:
    strategy = FSDPStrategy(mesh=plan, shard_modules={Block})
fabric = Fabric(accelerator="cpu", devices=plan.resolve(plan.size).size, strategy=strategy)
fabric.launch()
loader = fabric.setup_dataloaders(DataLoader(TensorDataset(tokens), batch_size=loader_batch))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    """Train on the batches of ``steps``; the loss of each step averaged over the ranks (= over the global batch)."""
    losses = []
    for step, (batch,) in enumerate(loader):
        if step not in steps:
            continue
        optimizer.zero_grad()
        # with pipeline stages, the forward and backward of every stage run in the model's call
        loss = model(batch[:, :-1], target=batch[:, 1:]) if pipeline > 1 else loss_of(model, batch)
        fabric.backward(loss)
        optimizer.step()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    return losses


def all_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """Full weights of the whole model: under pipeline parallelism each stage's, gathered from every rank."""
    own = full_weights(module)
    if pipeline == 1:
        return own
    stages: list[dict[str, torch.Tensor]] = [{} for _ in range(fabric.world_size)]
    torch.distributed.all_gather_object(stages, own)
    return {name: value for stage in stages for name, value in stage.items()}


model = make_model()
optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
model, optimizer = fabric.setup(model, optimizer)
report: dict[str, object] = {
    "mesh": dict(zip(strategy.mesh.mesh_dim_names or (), strategy.mesh.shape, strict=True)),
    "data_parallel_shard": strategy.data_parallel_shard,
    "losses": train(model, optimizer, range(STEPS)),
    "weights": all_weights(model.module),
}
fabric.save(out_dir / f"ckpt-{tag}", {"model": model, "optimizer": optimizer, "step": STEPS})

if load_dir is not None:  # continue from a checkpoint another mesh shape saved
    fresh = make_model(seed=123)  # other initial weights: all must come from the checkpoint
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=LR)
    fresh, fresh_optimizer = fabric.setup(fresh, fresh_optimizer)
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    fabric.load(load_dir, state)
    report["loaded_weights"] = all_weights(fresh.module)
    report["resumed_losses"] = train(fresh, fresh_optimizer, range(int(state["step"]), STEPS + EXTRA))
    report["final"] = all_weights(fresh.module)

shards = fabric.all_gather(torch.tensor(report["data_parallel_shard"]))
report["data_parallel_shards"] = shards.tolist()
if fabric.is_global_zero:
    torch.save(report, out_dir / f"{tag}.pt")
