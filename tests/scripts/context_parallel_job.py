"""Context parallelism through Fabric's loop on 4 real ranks (gloo), CUDA faked at its boundary, for
tests/strategies/test_context_parallel.py.

torch's ``context_parallel`` shards CUDA attention kernels only, so here the device check admits the CPU and torch's
function is replaced by an exact split of each buffer's sequence (this rank's contiguous part, restored on exit
unless in ``no_restore_buffers``): the model works on each position alone (no attention), for which the split is
exact. What runs for real is the rest: the mesh ``data_parallel=2 x context_parallel=2``, the batches (one per
data-parallel share, the same on both ranks of a context-parallel group), FSDP over ``data_parallel x
context_parallel`` and its gradient averaging, AdamW.

``python context_parallel_job.py OUT reference``: one process, the whole global batch of every step.
``python context_parallel_job.py OUT train``: the 4 ranks; rank 0 writes ``OUT/train.pt``.
``python context_parallel_job.py OUT different``: the same with every rank given its own samples (refused).
``python context_parallel_job.py OUT trainer``: the Trainer with ``parallelism_config``'s ``cp`` section; rank 0 writes
``OUT/trainer.pt``.
Both write the loss of each step and the weights after the last.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

GLOBAL_BATCH, SEQUENCE, STEPS, LR = 4, 6, 3, 1e-2

generator = torch.Generator().manual_seed(0)
inputs = torch.randn(GLOBAL_BATCH * STEPS, SEQUENCE, 8, generator=generator)
targets = torch.randn(GLOBAL_BATCH * STEPS, SEQUENCE, 4, generator=generator)
out_dir, mode = Path(sys.argv[1]), sys.argv[2]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))  # each position on its own


if mode == "reference":
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        part = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        loss = F.mse_loss(model(inputs[part]), targets[part])  # the mean over every position of the global batch
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    weights = {name: value.detach().clone() for name, value in model.state_dict().items()}
    torch.save({"losses": losses, "weights": weights}, out_dir / "reference.pt")
    sys.exit(0)

import fabric.strategies.context_parallel as context_parallel  # noqa: E402
from fabric import Fabric  # noqa: E402
from fabric.strategies import MeshPlan, ModelParallelStrategy  # noqa: E402

seen: list[dict[str, object]] = []


@contextmanager
def split_sequences(
    mesh: object, *, buffers: list[torch.Tensor], buffer_seq_dims: list[int], no_restore_buffers: set[torch.Tensor]
) -> Iterator[None]:
    """What torch's ``context_parallel`` does to the buffers, with a contiguous split."""
    rank, size = mesh.get_local_rank(), mesh.size()  # type: ignore[attr-defined]
    whole = [buffer.clone() for buffer in buffers]
    for buffer, original, dim in zip(buffers, whole, buffer_seq_dims, strict=True):
        part = original.chunk(size, dim)[rank]
        buffer.resize_(part.shape).copy_(part)
    seen.append({"mesh": mesh.mesh_dim_names, "shapes": [tuple(buffer.shape) for buffer in buffers]})  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for buffer, original in zip(buffers, whole, strict=True):
            if buffer not in no_restore_buffers:
                buffer.resize_(original.shape).copy_(original)


context_parallel.DEVICE_TYPES = ("cuda", "cpu")
context_parallel.torch_context_parallel = lambda: split_sequences  # type: ignore[assignment,return-value]

if mode == "trainer":  # the Trainer from parallelism_config's cp section, on the same batches
    from fabric.trainer import ComposerModel, Trainer

    class PerPosition(ComposerModel):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
            return self.net(batch[0])  # type: ignore[no-any-return]

        def loss(self, outputs: torch.Tensor, batch: list[torch.Tensor]) -> torch.Tensor:
            return F.mse_loss(outputs, batch[1])

    composer_model = PerPosition()
    cp = {"context_parallel_degree": 2, "seq_dims": {0: 1, 1: 1}}  # inputs and targets: (batch, sequence, features)
    trainer = Trainer(
        model=composer_model,
        train_dataloader=DataLoader(TensorDataset(inputs, targets), batch_size=GLOBAL_BATCH // 2),
        max_duration=f"{STEPS}ba",
        optimizers=torch.optim.AdamW(composer_model.parameters(), lr=LR),
        parallelism_config={"fsdp": {"data_parallel_shard_degree": 2}, "cp": cp},
        accelerator="cpu",
        devices=4,
        progress_bar=False,
    )
    trainer.fit()
    loss = trainer.fabric.all_reduce(trainer.state.loss, reduce_op="mean").item()
    weights = {name: value.full_tensor().detach() for name, value in composer_model.net.state_dict().items()}
    if trainer.fabric.is_global_zero:
        clock = trainer.state.timestamp.state_dict()
        torch.save({"weights": weights, "loss": loss, "seen": seen, "timestamp": clock}, out_dir / "trainer.pt")
    sys.exit(0)

strategy = ModelParallelStrategy(mesh=MeshPlan(data_parallel=2, context_parallel=2))
fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)
fabric.launch()
model = make_model()
model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
loader = fabric.setup_dataloaders(DataLoader(TensorDataset(inputs, targets), batch_size=GLOBAL_BATCH // 2))
if mode == "different":  # a loader that splits the data over every rank, as a self-sharding dataset does
    own = slice(fabric.global_rank, None, fabric.world_size)
    loader = DataLoader(TensorDataset(inputs[own], targets[own]), batch_size=1)  # type: ignore[assignment]
losses, restored = [], []
for batch_inputs, batch_targets in loader:
    with fabric.context_parallel([batch_inputs, batch_targets], seq_dims=[1, 1], no_restore=[batch_targets]):
        loss = F.mse_loss(model(batch_inputs), batch_targets)  # this rank's part of the sequence
        fabric.backward(loss)
    restored.append((tuple(batch_inputs.shape), tuple(batch_targets.shape)))
    optimizer.step()
    optimizer.zero_grad()
    losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
weights = {name: value.full_tensor().detach() for name, value in model.module.state_dict().items()}
shard_meshes = {param.device_mesh.mesh_dim_names for param in model.parameters()}  # type: ignore[attr-defined]
shares = fabric.all_gather(torch.tensor(strategy.data_parallel_shard)).tolist()
if fabric.is_global_zero:
    report = {"losses": losses, "weights": weights, "seen": seen, "restored": restored}
    report |= {"shard_meshes": shard_meshes, "shares": shares}
    torch.save(report, out_dir / "train.pt")
