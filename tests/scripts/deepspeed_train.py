"""ZeRO stages 1, 2, 3 and the offloading variants in one 2-rank job (start it with torchrun):
``deepspeed_train.py OUT_DIR``.

For each strategy, every rank trains the same small model on its half of the data (two micro-batches per
step, the first under ``no_backward_sync``), takes ``model.state_dict()``, saves a sharded checkpoint,
loads it into a freshly initialised engine, and computes the single-process full-batch reference itself
with plain torch.
Each rank writes what it saw to ``OUT_DIR/rank{R}.json``; checkpoints go to ``OUT_DIR/<strategy>``.
``fabric.setup(model, optimizer, scheduler=...)`` under stage 2 is run too (the engine steps the scheduler).
Under stage 2, poisoned copies of the checkpoint (a payload in the client state, then in one rank's
optimizer shard) are loaded too: each load must be refused before anything changes, running nothing.
"""

import json
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.nn.functional as F
from marker_payload import MarkerPayload
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric
from fabric.utilities.exceptions import CheckpointError
from fabric.utilities.processes.exit import exit_process

STEPS = 3
LR = 0.05

out_dir = Path(sys.argv[1])
x = torch.randn(32, 6, generator=torch.Generator().manual_seed(1))
y = x.sum(dim=1, keepdim=True).sin()


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def reference() -> list[list[float]]:
    """One process, the full batch, plain torch."""
    model = make_model(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for _ in range(STEPS):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def full_parameters(model: torch.nn.Module) -> list[list[float]]:
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):  # a no-op below stage 3
        return [p.detach().float().flatten().tolist() for p in params]


def optimizer_tensors(engine: Any) -> list[torch.Tensor]:
    """This rank's shard of the optimizer: its fp32 master partitions and the Adam moments."""
    base = engine.optimizer.optimizer
    tensors = [p.detach().clone() for group in base.param_groups for p in group["params"]]
    for state in base.state.values():
        tensors += [value.detach().clone() for _, value in sorted(state.items())]
    return tensors


def setup(fabric: Fabric, seed: int) -> tuple[Any, Any]:
    with fabric.init_module():
        model = make_model(seed)
    return fabric.setup(model, torch.optim.Adam(model.parameters(), lr=LR))


def load_poisoned(fabric: Fabric, checkpoint: Path) -> dict[str, Any]:
    """Load copies of ``checkpoint`` with a payload in the client state, then in rank 1's optimizer shard."""
    results = {}
    for part, pattern in (("client_state", "*model_states.pt"), ("optimizer", "zero_pp_rank_1_*optim_states.pt")):
        poisoned, marker = out_dir / f"poisoned_{part}", out_dir / f"marker_{part}"
        if fabric.is_global_zero:
            shutil.copytree(checkpoint, poisoned)
            file = next(poisoned.glob(f"*/{pattern}"))
            saved = torch.load(file, weights_only=False)  # our own checkpoint
            if part == "client_state":
                saved["fabric_client_state"]["step"] = MarkerPayload(marker)
            else:
                saved["extra"] = MarkerPayload(marker)
            torch.save(saved, file)
        fabric.barrier()
        model, optimizer = setup(fabric, seed=7)
        before = full_parameters(model)
        try:
            fabric.load(poisoned, {"model": model, "optimizer": optimizer, "step": 0})
            error = ""
        except CheckpointError as refused:
            error = str(refused)
        fabric.barrier()
        results[part] = {"error": error, "ran": marker.exists(), "unchanged": full_parameters(model) == before}
    return results


def run(strategy: str) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2)
    fabric.launch()
    model, optimizer = setup(fabric, seed=0)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=8))
    losses = []
    for _ in range(STEPS):
        batches = list(loader)
        optimizer.zero_grad()
        with fabric.no_backward_sync(model):
            fabric.backward(F.mse_loss(model(batches[0][0]), batches[0][1]) / 2)
        loss = F.mse_loss(model(batches[1][0]), batches[1][1]) / 2
        fabric.backward(loss)
        optimizer.step()
        losses.append(fabric.all_reduce(loss.detach()).item())
    trained = full_parameters(model)
    engine = model._forward_module
    partition = None
    if fabric.strategy.zero_stage == 3:
        params = list(engine.module.parameters())
        partition = sum(p.ds_tensor.numel() for p in params) / sum(p.ds_numel for p in params)

    # model.state_dict() gives full tensors under every stage (ZeRO-3 gathers them); the module's own is partitioned.
    state_dict = [value.float().flatten().tolist() for value in model.state_dict().values()]
    own_state_numel = sum(value.numel() for value in engine.module.state_dict().values())
    try:
        model.state_dict(keep_vars=True)
        keep_vars_error = ""
    except ValueError as error:
        keep_vars_error = str(error)

    checkpoint = out_dir / strategy
    fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "step": 5})
    saved_optimizer = optimizer_tensors(engine)
    fresh_model, fresh_optimizer = setup(fabric, seed=123)
    state = {"model": fresh_model, "optimizer": fresh_optimizer, "step": 0}
    remainder = fabric.load(checkpoint, state)
    loaded_optimizer = optimizer_tensors(fresh_model._forward_module)
    poisoned = load_poisoned(fabric, checkpoint) if strategy == "deepspeed_stage_2" else None
    return {
        "poisoned": poisoned,
        "micro_batch_size": fabric.strategy.config["train_micro_batch_size_per_gpu"],
        "losses": losses,
        "params": trained,
        "partition_fraction": partition,
        "state_dict": state_dict,
        "own_state_numel": own_state_numel,
        "keep_vars_error": keep_vars_error,
        "loaded_step": state["step"],
        "remainder": sorted(remainder),
        "loaded_params_equal": full_parameters(fresh_model) == trained,
        "loaded_optimizer_equal": len(saved_optimizer) == len(loaded_optimizer) > 0
        and all(torch.equal(a, b) for a, b in zip(saved_optimizer, loaded_optimizer, strict=True)),
        "world_size": fabric.world_size,
    }


def scheduled_reference() -> list[list[float]]:
    """One process, the full batch, plain torch: SGD whose learning rate halves after every step."""
    model = make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(STEPS):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        scheduler.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def run_scheduled() -> dict[str, Any]:
    """``fabric.setup(model, optimizer, scheduler=...)`` under ZeRO-2: the engine steps the scheduler."""
    fabric = Fabric(accelerator="cpu", strategy="deepspeed_stage_2", devices=2)
    fabric.launch()

    def set_up(seed: int) -> tuple[Any, Any, Any, Any]:
        with fabric.init_module():
            model = make_model(seed)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return *fabric.setup(model, optimizer, scheduler=scheduler), scheduler

    model, optimizer, returned, scheduler = set_up(seed=0)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=16))
    learning_rates = []
    for _ in range(STEPS):
        for inputs, targets in loader:  # one batch of 16 per rank: the full batch of 32 per step
            optimizer.zero_grad()
            fabric.backward(F.mse_loss(model(inputs), targets))
            optimizer.step()
        learning_rates.append(optimizer.param_groups[0]["lr"])
    trained = full_parameters(model)
    fabric.save(out_dir / "scheduled", {"model": model, "optimizer": optimizer, "scheduler": scheduler})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler.step()  # the user's own step on top of the engine's: the schedule would run ahead
        optimizer.zero_grad()
        fabric.backward(F.mse_loss(model(x[:16]), y[:16]))
        optimizer.step()
    fresh_model, fresh_optimizer, _, fresh_scheduler = set_up(seed=123)
    fabric.load(
        out_dir / "scheduled", {"model": fresh_model, "optimizer": fresh_optimizer, "scheduler": fresh_scheduler}
    )
    return {
        "returned_is_scheduler": returned is scheduler,
        "learning_rates": learning_rates,
        "params": trained,
        "reference": scheduled_reference(),
        "warnings": [str(warning.message) for warning in caught if "scheduler.step()" in str(warning.message)],
        "loaded_last_epoch": fresh_scheduler.last_epoch,
        "loaded_lr": fresh_optimizer.param_groups[0]["lr"],
    }


results: dict[str, Any] = {"reference": reference(), "scheduled": run_scheduled()}
for name in (
    "deepspeed_stage_1",
    "deepspeed_stage_2",
    "deepspeed_stage_3",
    "deepspeed_stage_2_offload",
    "deepspeed_stage_3_offload",
):
    results[name] = run(name)
rank = torch.distributed.get_rank()
(out_dir / f"rank{rank}.json").write_text(json.dumps(results))
exit_process(0, run_registered_cleanups=True)
