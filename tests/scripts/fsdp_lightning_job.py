"""FSDPStrategy configured with Lightning Fabric's arguments, on 2 CPU ranks (gloo), next to a plain single-process
reference on the full batch: ``python fsdp_lightning_job.py OUT_DIR CONFIG`` (run by
tests/strategies/fsdp/test_fsdp_lightning_args.py).

CONFIG is one of

- ``shard_grad_op``: ``auto_wrap_policy={Block}, sharding_strategy="SHARD_GRAD_OP",
  activation_checkpointing_policy={Block}, sync_module_states=True``; the ranks build the model from different
  seeds, so only the broadcast from rank 0 makes them train the reference's model.
- ``hybrid``: ``sharding_strategy=ShardingStrategy.HYBRID_SHARD`` with ``num_nodes=1``, an FSDP1 size-based
  ``auto_wrap_policy``, ``cpu_offload=CPUOffload(offload_params=False)``, ``use_orig_params=True``,
  ``limit_all_gathers=True``; a sharded save reloaded into a fresh model.
- ``no_shard``: ``sharding_strategy="no_shard"`` with ``mixed_precision=MixedPrecision(param_dtype=bfloat16,
  reduce_dtype=float32)``; a sharded save reloaded into a fresh model.

Every rank writes what it found to ``OUT_DIR/<CONFIG>-rank<R>.json``.
"""

import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import CPUOffload, FSDPModule, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
from torch.distributed.tensor import DTensor

from fabric import Fabric
from fabric.strategies.fsdp import FSDPStrategy

out_dir = Path(sys.argv[1])
config = sys.argv[2]
STEPS, LR = 4, 0.05


class Block(nn.Module):
    """A residual layer that counts its forward calls (activation checkpointing runs it again in the backward)."""

    calls = 0

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.seen_dtypes: list[torch.dtype] = []

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        Block.calls += 1
        self.seen_dtypes.append(self.linear.weight.dtype)
        return inputs + torch.tanh(self.linear(inputs))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList([Block(16), Block(16)])
        self.head = nn.Linear(16, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.inp(inputs)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().float().clone()


STRATEGIES: dict[str, dict[str, Any]] = {
    "shard_grad_op": {
        "auto_wrap_policy": {Block},
        "sharding_strategy": "SHARD_GRAD_OP",
        "activation_checkpointing_policy": {Block},
        "sync_module_states": True,
    },
    "hybrid": {
        "sharding_strategy": ShardingStrategy.HYBRID_SHARD,
        "auto_wrap_policy": functools.partial(size_based_auto_wrap_policy, min_num_params=200),
        "cpu_offload": CPUOffload(offload_params=False),
        "use_orig_params": True,
        "limit_all_gathers": True,
    },
    "no_shard": {
        "sharding_strategy": "no_shard",
        "mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    },
}

strategy = FSDPStrategy(**STRATEGIES[config])
fabric = Fabric(accelerator="cpu", devices=2, num_nodes=1, strategy=strategy)
fabric.launch()
rank = fabric.global_rank
report: dict[str, Any] = {"world_size": fabric.world_size}
x = torch.randn(64, 6, generator=torch.Generator().manual_seed(1))
y = x.sum(dim=1, keepdim=True).sin()

torch.manual_seed(100)
reference = Net()
torch.manual_seed(100 + rank if config == "shard_grad_op" else 100)  # only sync_module_states makes them equal
model = Net()
report["init_equals_reference"] = all(
    torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True)
)
model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=LR))
report["set_up_equals_reference"] = all(
    torch.equal(full(a), b) for a, b in zip(model.parameters(), reference.parameters(), strict=True)
)
inner = model.module
report["units"] = sorted(name for name, module in inner.named_modules() if isinstance(module, FSDPModule))
sharded_over = fabric.strategy.data_parallel_mesh  # type: ignore[attr-defined]
report["mesh"] = [list(sharded_over.shape), list(sharded_over.mesh_dim_names or ())]
report["placements"] = [str(p) for p in inner.head.weight.placements]
report["local_numel"] = sum(p.to_local().numel() for p in model.parameters())
report["total_numel"] = sum(p.numel() for p in model.parameters())
report["sharded_dtype"] = str(inner.head.weight.dtype)

initial = [p.detach().clone() for p in reference.parameters()]
reference_optimizer = torch.optim.Adam(reference.parameters(), lr=LR)
calls, gathered_between = [], []
for step in range(STEPS):
    batch = slice((step % 2) * 32, (step % 2) * 32 + 32)
    mine = slice(batch.start + rank * 16, batch.start + rank * 16 + 16)
    optimizer.zero_grad()
    Block.calls = 0
    loss = F.mse_loss(model(x[mine]).float(), y[mine])
    # reshard_after_forward=False keeps a unit's gathered (plain) parameters until its backward
    gathered_between.append(not isinstance(inner.blocks[0].linear.weight, DTensor))
    fabric.backward(loss)
    calls.append(Block.calls)
    optimizer.step()

    reference_optimizer.zero_grad()
    F.mse_loss(reference(x[batch]), y[batch]).backward()
    reference_optimizer.step()
report["block_calls_per_step"] = calls
report["gathered_between_forward_and_backward"] = gathered_between
report["dtypes_in_forward"] = sorted({str(dtype) for dtype in inner.blocks[0].seen_dtypes})
trained = [full(p) for p in model.parameters()]
report["trained"] = [p.flatten().tolist() for p in trained]
report["max_diff_to_reference"] = max(
    (a - b).abs().max().item() for a, b in zip(trained, reference.parameters(), strict=True)
)
report["moved"] = max((a - b).abs().max().item() for a, b in zip(trained, initial, strict=True))

if config != "shard_grad_op":  # a sharded checkpoint of this layout reloads exactly into a fresh model
    fabric.save(out_dir / f"{config}-checkpoint", {"model": model, "optimizer": optimizer})
    torch.manual_seed(7)
    fresh = Net()
    fresh, fresh_optimizer = fabric.setup(fresh, torch.optim.Adam(fresh.parameters(), lr=LR))
    fabric.load(out_dir / f"{config}-checkpoint", {"model": fresh, "optimizer": fresh_optimizer})
    report["reload_equal"] = all(torch.equal(full(a), b) for a, b in zip(fresh.parameters(), trained, strict=True))

(out_dir / f"{config}-rank{rank}.json").write_text(json.dumps(report))
