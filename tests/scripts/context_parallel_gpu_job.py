"""torch's context parallelism (ring attention) through Fabric on one real GPU, for
tests/gpu/test_real_cuda_context_parallel.py.

Why two ranks on one GPU, over gloo: with ``context_parallel=1`` Fabric never enters torch's ``context_parallel``
(``fabric.context_parallel`` changes nothing there), so a one-process run would prove nothing about it; NCCL refuses
two ranks on one GPU, but gloo carries CUDA tensors (through pinned host copies) for every collective the run needs:
ring attention's all-gather of keys and values and all-to-all of their gradients, FSDP2's all-gather and
reduce-scatter (an all-reduce in gloo), ``fabric.all_reduce``. The test starts the two processes with torchrun's
variables as two nodes of one GPU each, so both take ``cuda:0`` (``LOCAL_RANK`` 0).

``python context_parallel_gpu_job.py OUT PRECISION reference``: one process, no process group, plain
``scaled_dot_product_attention`` on the whole sequences; writes ``OUT/reference-PRECISION.pt``.

``python context_parallel_gpu_job.py OUT PRECISION train``: one of the two ranks of
``ModelParallelStrategy(mesh=MeshPlan(data_parallel=1, context_parallel=2), process_group_backend="gloo")`` on
``cuda``; inside ``fabric.context_parallel`` each rank holds half of every sequence (torch's load-balanced split of
the tokens, the targets and the model's positional buffer) and attention runs as ring attention on the flash or
memory-efficient kernel; rank 0 writes ``OUT/train-PRECISION.pt``.

Both write the loss of each step (over the whole batch), the gradients of the first step and the weights after the
last, as float32 on the CPU. PRECISION is Fabric's ``32-true`` or ``bf16-true`` (the reference's model in that dtype).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

VOCAB, DIM, HEADS, LENGTH, LAYERS = 128, 64, 4, 64, 2  # LENGTH: a multiple of 2 x 2 ranks (torch's load balancing)
BATCH, STEPS, LR = 4, 3, 1e-2
DTYPES = {"32-true": torch.float32, "bf16-true": torch.bfloat16}


def sinusoids(length: int, dim: int) -> torch.Tensor:
    position = torch.arange(length, dtype=torch.float32)[:, None]
    frequency = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2], table[:, 1::2] = torch.sin(position * frequency), torch.cos(position * frequency)
    return table


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(3))
        self.k = nn.Linear(DIM, DIM, bias=False)  # softmax ignores a key bias: its gradient would be rounding noise
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        h = self.norm1(x)
        q, k, v = (
            part(h).view(batch, length, HEADS, DIM // HEADS).transpose(1, 2) for part in (self.q, self.k, self.v)
        )
        # under context parallelism torch runs this as ring attention over this rank's part of the sequence
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, length, DIM)
        x = x + self.o(attended)
        return x + self.down(F.gelu(self.up(self.norm2(x))))  # type: ignore[no-any-return]


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM)
        # a buffer along the sequence: split with the tokens inside the context (its seq dim is 0)
        self.register_buffer("positions", sinusoids(LENGTH, DIM), persistent=False)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens) + self.positions
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # type: ignore[no-any-return]


def make_model() -> Transformer:
    torch.manual_seed(0)  # on the CPU: the same initial weights in every process
    return Transformer()


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def as_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A whole float32 copy on the CPU (a DTensor shard gathered first: a collective)."""
    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return whole.detach().to("cpu", torch.float32, copy=True)


tokens = torch.randint(0, VOCAB, (BATCH * STEPS, LENGTH + 1), generator=torch.Generator().manual_seed(1))
out_dir, precision, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
dtype = DTYPES[precision]
CUDA = torch.device("cuda", 0)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = tokens[step * BATCH : (step + 1) * BATCH]
    return rows[:, :-1].contiguous().to(CUDA), rows[:, 1:].contiguous().to(CUDA)


if mode == "reference":
    model = make_model().to(CUDA, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses: list[float] = []
    gradients: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        inputs, targets = batch(step)
        loss = next_token_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        if step == 0:
            gradients = {name: as_cpu(p.grad) for name, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        losses.append(loss.item())
    weights = {name: as_cpu(p) for name, p in model.named_parameters()}
    report = {"losses": losses, "gradients": gradients, "weights": weights}
    torch.save(report, out_dir / f"reference-{precision}.pt")
    sys.exit(0)

from fabric import Fabric  # noqa: E402
from fabric.strategies import MeshPlan, ModelParallelStrategy  # noqa: E402

strategy = ModelParallelStrategy(mesh=MeshPlan(data_parallel=1, context_parallel=2), process_group_backend="gloo")
fabric = Fabric(accelerator="cuda", strategy=strategy, precision=precision)  # devices, nodes: torchrun's variables
fabric.launch()
module = make_model()
model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=LR))
positions = module.get_buffer("positions")  # the buffer the forward reads, on the GPU now
table = positions.detach().to("cpu", copy=True)
losses, gradients = [], {}
seen: list[list[tuple[int, ...]]] = []  # inside the context: the shapes of the inputs, the targets, the positions
part: dict[str, object] = {}  # which positions this rank held at the first step, and whether its tokens match them
for step in range(STEPS):
    inputs, targets = batch(step)  # the same whole batch on both ranks of the context-parallel group
    whole = inputs.to("cpu", copy=True)
    optimizer.zero_grad()
    with fabric.context_parallel([inputs, targets, positions], seq_dims=[1, 1, 0], no_restore=[inputs, targets]):
        seen.append([tuple(inputs.shape), tuple(targets.shape), tuple(positions.shape)])  # this rank's parts
        if step == 0:  # each row of the sinusoid table is unique: it names the position it came from
            held = [int((table - row).abs().sum(dim=1).argmin()) for row in positions.detach().cpu()]
            part = {"positions": held, "tokens_match": torch.equal(inputs.cpu(), whole[:, held])}
        loss = next_token_loss(model(inputs), targets)  # this rank's part of every sequence
        fabric.backward(loss)
    if step == 0:
        gradients = {name: as_cpu(p.grad) for name, p in module.named_parameters() if p.grad is not None}
    optimizer.step()
    losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())  # halves of equal length: the batch's
weights = {name: as_cpu(p) for name, p in module.named_parameters()}
parts: list[object] = [None] * fabric.world_size
torch.distributed.all_gather_object(parts, part)
report = {
    "losses": losses,
    "gradients": gradients,
    "weights": weights,
    "seen": seen,
    "parts": parts,
    "restored": tuple(positions.shape),
    "mesh": dict(zip(strategy.mesh.mesh_dim_names or (), strategy.mesh.shape, strict=True)),
    "shard_meshes": {p.device_mesh.mesh_dim_names for p in module.parameters() if isinstance(p, DTensor)},
    "device": str(next(module.parameters()).device),
    "backend": torch.distributed.get_backend(),
}
if fabric.is_global_zero:
    torch.save(report, out_dir / f"train-{precision}.pt")
