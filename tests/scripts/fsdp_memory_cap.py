"""A model with more parameters than each rank's memory cap, built on the meta device and trained with FSDP
on 2 CPU ranks: ``python fsdp_memory_cap.py OUT_DIR`` (run by tests/strategies/fsdp/test_sharded_memory.py).

Each rank caps its address space (``RLIMIT_AS``) at its current virtual size plus a margin of 0.8 x the
model's parameter bytes, then

1. materialises the same model fully, without FSDP, and expects that to fail (the cap is real), and
2. builds it under ``fabric.init_module(empty_init=True)``, lets ``fabric.setup`` shard and materialise
   it, and runs one training step.

It writes what happened to ``OUT_DIR/rank{R}.json``.

Choices, measured on the 2-core CPU machine this project is tested on (margins swept with this script):

- The model is 64 ``Linear(1024, 1024)`` layers, each its own FSDP unit: 256 MiB of float32 parameters,
  128 MiB per rank once sharded, and only 4 MiB gathered at a time. The sharded step failed with a
  margin of 0.60x the model and worked with 0.63x; materialising it fully failed at 0.95x and worked at
  1.02x. 0.8x (205 MiB) leaves at least 38 MiB on either side.
- Only the last 2 layers train (SGD, no optimizer state); the other 62 are frozen. With 2 ranks each
  rank's gradient shard is as large as its parameter shard, so sharded training of every parameter
  needs as much memory as the whole unsharded model's parameters, and no cap can refuse the one and
  allow the other. Every layer is still materialised, sharded, gathered and run forward.
- The baseline is taken after a warm-up step with a 3-layer model of the same layers, so that
  imports, gloo and autograd threads and other one-time allocations are not charged to the model.
- The test starts this script with ``MALLOC_ARENA_MAX=1`` and ``MALLOC_MMAP_THRESHOLD_=1048576``
  (checked below): each tensor is then its own mapping, returned on free, and no thread arena keeps
  reserved but unused address space in the baseline. With glibc's defaults the baseline held about
  60 MiB of such reservations, enough for a full materialisation to fit under the cap.
"""

import gc
import json
import os
import resource
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from fabric import Fabric
from fabric.strategies.fsdp import FSDPStrategy
from fabric.utilities.processes.exit import exit_process

WIDTH, DEPTH, TRAINED_LAYERS, MARGIN_FRACTION = 1024, 64, 2, 0.8
ALLOCATOR_SETTINGS = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "1048576"}

out_dir = Path(sys.argv[1])
if any(os.environ.get(name) != value for name, value in ALLOCATOR_SETTINGS.items()):
    sys.exit(f"fsdp_memory_cap.py needs the allocator settings {ALLOCATOR_SETTINGS} in its environment.")


def virtual_size() -> int:
    """This process's address space in bytes (what RLIMIT_AS limits)."""
    with open("/proc/self/status") as status:
        kib = next(line.split()[1] for line in status if line.startswith("VmSize:"))
    return int(kib) * 1024


def make_model(depth: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    model = nn.Sequential(*layers)
    model[: 2 * (depth - TRAINED_LAYERS)].requires_grad_(False)
    return model


def set_up(depth: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    with fabric.init_module(empty_init=True):
        meta_model = make_model(depth)
    model = fabric.setup(meta_model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return model, fabric.setup_optimizers(optimizer)


def local_shard(parameter: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded parameter."""
    assert isinstance(parameter, DTensor)
    return parameter.to_local()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    inputs = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(fabric.global_rank))
    loss = F.mse_loss(model(inputs), inputs.sin())
    optimizer.zero_grad()
    fabric.backward(loss)
    optimizer.step()
    return loss.item()


def materialise_unsharded() -> str:
    """Allocate and initialise the whole model in this process, as without FSDP; the error, if any."""
    with torch.device("meta"):
        model = make_model(DEPTH)
    try:
        model.to_empty(device="cpu")
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()
    except (MemoryError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    finally:
        del model
        gc.collect()
    return ""


fabric = Fabric(
    accelerator="cpu", devices=2, strategy=FSDPStrategy(shard_modules={nn.Linear}, timeout=timedelta(seconds=60))
)
fabric.launch()
train_step(*set_up(TRAINED_LAYERS + 1))  # the warm-up
gc.collect()

model_bytes = DEPTH * (WIDTH * WIDTH + WIDTH) * 4
baseline = virtual_size()
cap = baseline + int(MARGIN_FRACTION * model_bytes)
resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))

report: dict[str, object] = {"model_bytes": model_bytes, "cap_over_baseline": cap - baseline}
report["unsharded_error"] = materialise_unsharded()
report["after_unsharded_over_baseline"] = virtual_size() - baseline

model, optimizer = set_up(DEPTH)
trained = [p for p in model.parameters() if p.requires_grad]
before = [local_shard(p).clone() for p in trained]
report["loss"] = train_step(model, optimizer)
report["trained_changed"] = [not torch.equal(local_shard(p), b) for p, b in zip(trained, before, strict=True)]
report["local_numel"] = sum(local_shard(p).numel() for p in model.parameters())
report["total_numel"] = sum(p.numel() for p in model.parameters())
report["sharded_over_baseline"] = virtual_size() - baseline
(out_dir / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))
exit_process(0, run_registered_cleanups=True)
