"""FSDP jobs for tests/strategies/fsdp/test_fsdp.py: ``python fsdp_job.py OUT_DIR train|reload [DEVICES]``.

``train`` (2 ranks): trains with gradient accumulation and clipping next to a plain single-process
reference on the full batch, saves a sharded and a full checkpoint, reloads, checks meta-device init,
a failed load and a 1-node hybrid (2-D mesh) shard. ``reload`` (any number of ranks): loads both
checkpoints into a fresh model. Every rank writes what it found to ``OUT_DIR/<mode>-rank<R>.json``;
rank 0 also writes full tensors to ``OUT_DIR/<mode>.pt``.
"""

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from fabric import Fabric
from fabric.strategies.fsdp import FSDPStrategy
from fabric.utilities.exceptions import CheckpointError

out_dir = Path(sys.argv[1])
mode = sys.argv[2]
devices = int(sys.argv[3]) if len(sys.argv) > 3 else 2
STEPS, LR, MAX_NORM = 4, 0.05, 0.5


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [[full(optimizer.state[p][name]) for name in ("step", "exp_avg", "exp_avg_sq")] for p in params]


fabric = Fabric(accelerator="cpu", strategy=FSDPStrategy(shard_modules={nn.Linear}), devices=devices)
fabric.launch()
report: dict[str, object] = {"world_size": fabric.world_size}
tensors: dict[str, object] = {}
x = torch.randn(64, 6, generator=torch.Generator().manual_seed(1))
y = x.sum(dim=1, keepdim=True).sin()

if mode == "train":
    torch.manual_seed(0)
    reference = make_model()
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)  # built before setup: must be re-pointed
    model, optimizer = fabric.setup(model, optimizer)
    report["local_numel"] = sum(p.to_local().numel() for p in model.parameters())
    report["total_numel"] = sum(p.numel() for p in model.parameters())
    report["all_dtensors"] = all(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"])

    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=LR)
    share = 32 // fabric.world_size
    norms, reference_norms = [], []
    for step in range(STEPS):
        batch = slice((step % 2) * 32, (step % 2) * 32 + 32)
        mine = slice(batch.start + fabric.global_rank * share, batch.start + (fabric.global_rank + 1) * share)
        half = share // 2
        optimizer.zero_grad()
        with fabric.no_backward_sync(model):  # accumulate the first micro-batch without communicating
            fabric.backward(F.mse_loss(model(x[mine][:half]), y[mine][:half]) / 2)
        fabric.backward(F.mse_loss(model(x[mine][half:]), y[mine][half:]) / 2)
        norms.append(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM).item())
        optimizer.step()

        reference_optimizer.zero_grad()
        F.mse_loss(reference(x[batch]), y[batch]).backward()
        reference_norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM).item())
        reference_optimizer.step()
    report["norms"], report["reference_norms"] = norms, reference_norms
    trained = [full(p) for p in model.parameters()]
    report["max_diff_to_reference"] = max(
        (a - b).abs().max().item() for a, b in zip(trained, reference.parameters(), strict=True)
    )

    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(list(range(8)), batch_size=2))
    fabric.save(out_dir / "sharded", {"model": model, "optimizer": optimizer, "step": 5, "loader": loader})
    fabric.strategy.state_dict_type = "full"  # type: ignore[attr-defined]
    fabric.save(out_dir / "full.pt", {"model": model, "optimizer": optimizer, "step": 5})
    fabric.strategy.state_dict_type = "sharded"  # type: ignore[attr-defined]
    report["sharded_files"] = sorted(path.name for path in (out_dir / "sharded").iterdir())
    tensors["params"], tensors["optimizer"] = trained, full_optimizer_state(optimizer)

    # Reload into fresh objects on the same 2 ranks.
    try:  # an optimizer over another model's parameters is refused, naming the fix
        fabric.setup(make_model(), torch.optim.Adam(make_model().parameters(), lr=LR))
        report["foreign_optimizer"] = "accepted"
    except ValueError as error:
        report["foreign_optimizer"] = str(error)
    fresh = make_model()
    fresh, fresh_optimizer = fabric.setup(fresh, torch.optim.Adam(fresh.parameters(), lr=LR))
    live_loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(list(range(4))))
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0, "loader": live_loader}
    fabric.load(out_dir / "sharded", state)  # weights_only=True, the default: the saved loader is kept opaque
    report["reload_step"] = state["step"]
    report["reload_kept_the_live_loader"] = state["loader"] is live_loader
    report["reload_params_equal"] = all(
        torch.equal(full(a), b) for a, b in zip(fresh.parameters(), trained, strict=True)
    )
    report["reload_optimizer_equal"] = all(
        torch.equal(a, b)
        for mine_state, saved_state in zip(full_optimizer_state(fresh_optimizer), tensors["optimizer"], strict=True)
        for a, b in zip(mine_state, saved_state, strict=True)
    )

    # A failed load (a checkpoint of another shape) raises and changes nothing.
    wide = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    wide_model, wide_optimizer = fabric.setup(wide, torch.optim.Adam(wide.parameters(), lr=LR))
    before = [full(p) for p in wide_model.parameters()]
    try:
        fabric.load(out_dir / "sharded", {"model": wide_model, "optimizer": wide_optimizer, "step": 0})
        report["failed_load"] = "no error"
    except CheckpointError as error:
        report["failed_load"] = type(error).__name__
    report["failed_load_unchanged"] = all(
        torch.equal(full(a), b) for a, b in zip(wide_model.parameters(), before, strict=True)
    )
    report["failed_load_optimizer_empty"] = len(wide_optimizer.state) == 0

    # Meta-device init: nothing allocated until setup, then shards materialised by reset_parameters(), each rank's
    # shard its part of the tensor one process draws with the same seed (on CPU every rank drew the same shard).
    torch.manual_seed(11)
    seeded = make_model()
    torch.manual_seed(11)
    with fabric.init_module(empty_init=True):
        meta_model = make_model()
    report["meta_before_setup"] = all(p.is_meta for p in meta_model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta_model = fabric.setup(meta_model)
    report["meta_setup_warnings"] = [str(warning.message) for warning in caught]
    report["meta_equals_seeded_init"] = all(
        torch.equal(full(a), b) for a, b in zip(meta_model.parameters(), seeded.parameters(), strict=True)
    )
    linears = [m for m in meta_model.modules() if isinstance(m, nn.Linear)]
    report["meta_finite"] = all(torch.isfinite(full(p)).all().item() for p in meta_model.parameters())
    report["meta_within_init_bounds"] = all(
        full(m.weight).abs().max().item() <= m.in_features**-0.5 and full(m.weight).abs().max().item() > 0
        for m in linears
    )

    # A model with Composer's param_init_fn(module) (llm-foundry's MPT: its configured init) initialises its whole
    # subtree with it, not with the submodules' reset_parameters(); its own tensors count as initialised.
    class InitsItself(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = make_model()
            self.scale = nn.Parameter(torch.empty(1))

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return self.body(inputs) * self.scale

        def param_init_fn(self, module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.constant_(module.weight, 0.25)
                nn.init.zeros_(module.bias)
            if module is self:
                nn.init.constant_(self.scale, 2.0)

    with fabric.init_module(empty_init=True):
        inits_itself = InitsItself()
    inits_itself = fabric.setup(inits_itself)
    inits_linears = [m for m in inits_itself.modules() if isinstance(m, nn.Linear)]
    report["param_init_fn_used"] = (
        all(torch.all(full(m.weight) == 0.25).item() and torch.all(full(m.bias) == 0).item() for m in inits_linears)
        and full(inits_itself.scale).tolist() == [2.0]
        and torch.isfinite(inits_itself(x[:2])).all().item()
    )

    # A meta module whose tensors no reset_parameters() covers refuses to run until a checkpoint fills it.
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = make_model()
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return self.body(inputs) * self.scale

    with fabric.init_module(empty_init=True):
        scaled = Scaled()
    scaled = fabric.setup(scaled)
    try:
        scaled(x[:2])
        report["uninitialised_forward"] = "ran"
    except RuntimeError as error:
        report["uninitialised_forward"] = str(error)
    with fabric.init_module():
        source = Scaled()
    source = fabric.setup(source)
    fabric.save(out_dir / "scaled", {"model": source})
    fabric.load(out_dir / "scaled", {"model": scaled})
    report["after_load_forward_equal"] = torch.equal(scaled(x[:4]), source(x[:4]))

    # Hybrid sharding on one node: a (replicate=1, shard=2) mesh, trained one step like plain FSDP.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fabric.strategies.mesh import DATA_PARALLEL_DIMS

    mesh = init_device_mesh("cpu", (1, fabric.world_size), mesh_dim_names=DATA_PARALLEL_DIMS)
    torch.manual_seed(0)
    hybrid = nn.Linear(6, 4)
    torch.manual_seed(0)
    plain = nn.Linear(6, 4)
    fully_shard(hybrid, mesh=mesh)
    F.mse_loss(hybrid(x[mine]), y[mine].expand(-1, 4)).backward()
    F.mse_loss(plain(x[batch]), y[batch].expand(-1, 4)).backward()
    report["hybrid_mesh"] = [list(mesh.shape), list(mesh.mesh_dim_names or ())]
    report["hybrid_placements"] = [str(p) for p in hybrid.weight.placements]
    report["hybrid_grad_matches"] = torch.allclose(full(hybrid.weight.grad), plain.weight.grad, atol=1e-6)
else:
    torch.manual_seed(123)  # different initial weights: everything must come from the checkpoints
    model = make_model()
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=LR))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(out_dir / "sharded", state)
    report["step"] = state["step"]
    tensors["params"], tensors["optimizer"] = [full(p) for p in model.parameters()], full_optimizer_state(optimizer)
    model2 = make_model()
    model2, optimizer2 = fabric.setup(model2, torch.optim.Adam(model2.parameters(), lr=LR))
    state2 = {"model": model2, "optimizer": optimizer2, "step": 0}
    fabric.load(out_dir / "full.pt", state2)
    report["full_step"] = state2["step"]
    tensors["full_params"] = [full(p) for p in model2.parameters()]
    tensors["full_optimizer"] = full_optimizer_state(optimizer2)

(out_dir / f"{mode}-rank{fabric.global_rank}.json").write_text(json.dumps(report))
if fabric.global_rank == 0:
    torch.save(tensors, out_dir / f"{mode}.pt")
