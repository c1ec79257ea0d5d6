"""A Hugging Face Llama (random weights) on pipeline stages through a stage forward, for
tests/strategies/test_pipeline.py.

``python pipeline_huggingface_job.py OUT reference``: one process trains ``STEPS`` AdamW steps of the model's own
forward on the whole batches and writes ``OUT/reference.pt`` (losses, weights).

``python pipeline_huggingface_job.py OUT SCHEDULE``: 2 ranks (gloo) train the same steps with the model cut into
stages, 2 (``1F1B``) or 4 (``Interleaved1F1B``, 2 per rank), by ``PipelinePlan(stage_forward=llama_stage,
every_stage=("model.rotary_emb",))``: ``LlamaModel.forward`` calls its embedding and norm unconditionally, so each
stage runs ``llama_stage`` instead. Then saves a sharded checkpoint to ``OUT/ckpt-SCHEDULE``; rank 0 writes
``OUT/SCHEDULE.pt`` (losses, every stage's weights).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, LENGTH, BATCH, STEPS = 64, 12, 8, 3


def make_model() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def llama_stage(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One stage of a cut ``LlamaForCausalLM``: token ids in on the first stage, hidden states after; logits out of
    the last. Causal attention comes from SDPA without a mask."""
    inner: Any = model.model
    hidden = inner.embed_tokens(x) if inner.embed_tokens is not None else x
    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    rotary = inner.rotary_emb(hidden, position_ids=positions)
    for layer in inner.layers:
        hidden = layer(hidden, position_embeddings=rotary, position_ids=positions)
    if inner.norm is not None:
        hidden = inner.norm(hidden)
    return model.lm_head(hidden) if model.lm_head is not None else hidden  # type: ignore[no-any-return]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def main() -> None:
    """Train (``sys.argv``: OUT and ``reference`` or a schedule) and write the report."""
    tokens = torch.randint(0, VOCAB, (STEPS, BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(1))
    out_dir, mode = Path(sys.argv[1]), sys.argv[2]

    if mode == "reference":
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for batch in tokens:
            loss = next_token_loss(model(batch[:, :-1]).logits, batch[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        weights = {name: value.detach().clone() for name, value in model.named_parameters()}
        torch.save({"losses": losses, "weights": weights}, out_dir / "reference.pt")
        return

    from fabric import Fabric
    from fabric.strategies import MeshPlan, ModelParallelStrategy, PipelinePlan

    cuts = {"1F1B": ["model.layers.2"], "Interleaved1F1B": ["model.layers.1", "model.layers.2", "model.layers.3"]}
    plan = PipelinePlan(
        cuts[mode],
        next_token_loss,
        microbatches=2,
        schedule=mode,
        stage_forward=llama_stage,
        every_stage=("model.rotary_emb",),
    )
    fabric = Fabric(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(mesh=MeshPlan(pipeline_parallel=2, data_parallel=1), pipeline=plan),
    )
    fabric.launch()
    model = make_model()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = []
    for batch in tokens:
        loss = model(batch[:, :-1], target=batch[:, 1:])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    fabric.save(out_dir / f"ckpt-{mode}", {"model": model, "optimizer": optimizer})
    own = {name: value.full_tensor().detach() for name, value in model.module.named_parameters()}
    stages: list[dict[str, torch.Tensor]] = [{} for _ in range(fabric.world_size)]
    torch.distributed.all_gather_object(stages, own)
    if fabric.is_global_zero:
        weights = {name: value for stage in stages for name, value in stage.items()}
        torch.save({"losses": losses, "weights": weights}, out_dir / f"{mode}.pt")


if __name__ == "__main__":
    main()
