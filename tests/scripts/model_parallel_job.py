"""ModelParallelStrategy jobs for tests/strategies/test_model_parallel.py.

``python model_parallel_job.py OUT_DIR train DP TP [LOAD_DIR]`` (DP x TP ranks): tensor parallelism
(Colwise/Rowwise MLP) x FSDP2 trains from batches of ``setup_dataloaders``, clipping gradients, next to a
plain one-process reference that sees the batches of all ranks; saves a sharded checkpoint to
``OUT_DIR/ckpt-DPxTP``, and, given LOAD_DIR (saved on another mesh shape), loads it into a fresh model.
Rank 0 writes ``OUT_DIR/train-DPxTP.json`` and the full trained tensors to ``OUT_DIR/train-DPxTP.pt``.

``python model_parallel_job.py OUT_DIR load1 LOAD_DIR``: one process, a plain ``Fabric()``, loads LOAD_DIR into
an unparallelized model and writes ``OUT_DIR/load1.pt``.
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric
from fabric.strategies.model_parallel import ModelParallelStrategy

out_dir, mode = Path(sys.argv[1]), sys.argv[2]
STEPS, LR, BATCH, MAX_NORM = 3, 0.05, 4, 0.5


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 2))


def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}  # the last layer stays whole (sharded by FSDP)
    return parallelize_module(model, mesh["tensor_parallel"], plan)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = {f"param.{name}": full(p) for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        state[f"exp_avg.{name}"] = full(optimizer.state[p]["exp_avg"])
    return state


data = TensorDataset(torch.randn(64, 6, generator=torch.Generator().manual_seed(1)))

if mode == "load1":
    fabric = Fabric(accelerator="cpu", devices=1)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    model, optimizer = fabric.setup(model, optimizer)
    fabric.load(sys.argv[3], {"model": model, "optimizer": optimizer})
    torch.save(full_state(model.module, optimizer), out_dir / "load1.pt")
    sys.exit(0)

dp, tp = int(sys.argv[3]), int(sys.argv[4])
tag = f"{dp}x{tp}"
strategy = ModelParallelStrategy(parallelize, data_parallel_size=dp, tensor_parallel_size=tp)
fabric = Fabric(accelerator="cpu", devices=dp * tp, strategy=strategy)
fabric.launch()
report: dict[str, object] = {"world_size": fabric.world_size, "mesh": list(strategy.mesh.shape)}

reference = make_model()
reference_optimizer = torch.optim.Adam(reference.parameters(), lr=LR)
model = make_model()
optimizer = torch.optim.Adam(model.parameters(), lr=LR)  # built before setup: re-pointed at the shards
model, optimizer = fabric.setup(model, optimizer)
first = model.module[0].weight
report["tp_placements"] = [str(p) for p in first.placements]
report["local_rows_of_first_layer"] = first.to_local().shape[0]
loader = fabric.setup_dataloaders(DataLoader(data, batch_size=BATCH))
target = torch.tensor([0.5, -0.5])
batches_seen, norms, reference_norms = [], [], []
for step, (x,) in enumerate(loader):
    if step == STEPS:
        break
    loss = F.mse_loss(model(x), target.expand(len(x), 2))
    optimizer.zero_grad()
    fabric.backward(loss)
    norms.append(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM).item())  # TP and FSDP-only meshes
    optimizer.step()
    # the reference sees every rank's batch (a tensor-parallel group's ranks share one, which leaves the mean as is)
    everything = fabric.all_gather(x).reshape(-1, 6)
    batches_seen.append(fabric.all_gather(x[:, 0]).tolist())
    reference_loss = F.mse_loss(reference(everything), target.expand(len(everything), 2))
    reference_optimizer.zero_grad()
    reference_loss.backward()
    reference_norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM).item())
    reference_optimizer.step()

trained = full_state(model.module, optimizer)
expected = full_state(reference, reference_optimizer)
report["max_diff_to_reference"] = max((trained[key] - expected[key]).abs().max().item() for key in expected)
report["batches_seen"] = batches_seen
report["norms"], report["reference_norms"] = norms, reference_norms
fabric.save(out_dir / f"ckpt-{tag}", {"model": model, "optimizer": optimizer, "step": STEPS})

if len(sys.argv) > 5:  # a checkpoint saved on another mesh shape, into a fresh model on this one
    fresh = make_model()
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=LR)
    fresh, fresh_optimizer = fabric.setup(fresh, fresh_optimizer)
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    fabric.load(sys.argv[5], state)
    report["loaded_step"] = state["step"]
    loaded = full_state(fresh.module, fresh_optimizer)
    if fabric.is_global_zero:
        torch.save(loaded, out_dir / f"loaded-{tag}.pt")

if fabric.is_global_zero:
    torch.save(trained, out_dir / f"train-{tag}.pt")
    (out_dir / f"train-{tag}.json").write_text(json.dumps(report))
