"""fp8-mixed jobs for tests/plugins/test_float8.py: ``python float8_job.py OUT_DIR reference|fsdp [ALL_GATHER]``.

``reference``: one process trains the tiny language model in fp8-mixed, each step's batch as two halves whose
gradients accumulate (float8's activation scales are per forward, so this is what two ranks compute). ``fsdp``: two
ranks under FSDP2 each train on their half (``ALL_GATHER`` 1: the weights all-gathered in float8), save a sharded
checkpoint, and load it into a fresh model. Rank 0 writes the losses, the final full weights, the layer types and the
reloaded weights to ``OUT_DIR/<mode>[-all-gather].pt``.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from fabric import Fabric
from fabric.plugins.precision.float8 import Float8Precision

out_dir = Path(sys.argv[1])
mode = sys.argv[2]
all_gather = len(sys.argv) > 3 and sys.argv[3] == "1"
STEPS, VOCAB, WIDTH, HALVES = 6, 64, 32, 2


class TinyLM(nn.Module):
    """Embedding, two residual MLP blocks and an output head: the head's 32 -> 64 is left in bf16 by default."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
            for _ in range(2)
        )
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = hidden + block(hidden)
        return self.head(hidden)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return TinyLM()


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    def full(tensor: torch.Tensor) -> torch.Tensor:
        return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().float().clone()

    return {name: full(value) for name, value in model.state_dict().items()}


batches = torch.randint(0, VOCAB, (STEPS, HALVES * 8, 17), generator=torch.Generator().manual_seed(1))
plugin = Float8Precision(fsdp_float8_all_gather=all_gather)
losses = []
if mode == "reference":
    fabric = Fabric(accelerator="cpu", plugins=[plugin])
    module = make_model()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.5))
    for batch in batches:
        step_loss = 0.0
        for half in batch.chunk(HALVES):
            loss = loss_of(model, half) / HALVES
            fabric.backward(loss)
            step_loss += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    torch.save({"losses": losses, "weights": full_weights(model)}, out_dir / "reference.pt")
else:
    fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=HALVES, plugins=[plugin])
    fabric.launch()
    module = make_model()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)  # built before setup: Fabric re-points it
    model, optimizer = fabric.setup(module, optimizer)
    for batch in batches:
        loss = loss_of(model, batch.chunk(HALVES)[fabric.global_rank])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    layer_types = sorted({type(layer).__name__ for layer in model.modules() if isinstance(layer, nn.Linear)})
    trained = full_weights(model)
    checkpoint = out_dir / f"checkpoint{'-all-gather' if all_gather else ''}"
    fabric.save(checkpoint, {"model": model, "optimizer": optimizer})
    fresh = fabric.setup_module(make_model())
    fabric.load(checkpoint, {"model": fresh})
    reloaded = full_weights(fresh)
    if fabric.global_rank == 0:
        report = {"losses": losses, "weights": trained, "layer_types": layer_types, "reloaded": reloaded}
        torch.save(report, out_dir / f"fsdp{'-all-gather' if all_gather else ''}.pt")
