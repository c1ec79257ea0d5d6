"""Methods other than ``forward`` on 2 ranks: ``python forward_methods.py OUT_DIR STRATEGY``.

Every rank starts from weight 1.0 of a bias-free ``Linear(1, 1)`` and feeds its own input (2.0 on rank 0,
4.0 on rank 1), so the gradient of ``sum(w * x)`` is 2.0 and 4.0 before synchronisation and 3.0 (their
mean) after it. Each rank records what unmarked calls raised, the gradient after ``fabric.backward`` of a
marked method (DDP and FSDP; DeepSpeed keeps gradients to itself) and the weight after each SGD step
(lr 0.1), in ``OUT_DIR/rank{R}.json``.
"""

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fabric import Fabric

out_dir, strategy = Path(sys.argv[1]), sys.argv[2]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1, bias=False)
        self.criterion = nn.L1Loss(reduction="sum")  # a submodule without parameters
        nn.init.ones_(self.layer.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).sum()  # the module itself

    def layer_step(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).sum()  # a submodule with parameters

    def loss(self, outputs: torch.Tensor) -> torch.Tensor:
        return self.criterion(outputs, torch.zeros_like(outputs))


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def error_of(call: object) -> str | None:
    try:
        call()  # type: ignore[operator]
    except RuntimeError as error:
        return str(error)
    return None


fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2)
fabric.launch()
net = Net()
model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
x = torch.tensor([[2.0 * (fabric.global_rank + 1)]])
report: dict[str, object] = {
    "unmarked_self": error_of(lambda: model.training_step(x)),
    "unmarked_submodule": error_of(lambda: model.layer_step(x)),
    "unmarked_parameterless_loss": model.loss(torch.ones(2, 1)).item(),
}
fabric.mark_forward_method(model, "training_step")
model.mark_forward_method(Net.layer_step)
grads, weights = [], []
for step in (model.training_step, model.layer_step):
    optimizer.zero_grad()
    fabric.backward(step(x), model=model)
    if strategy in ("ddp", "fsdp"):
        grads.append(full(net.layer.weight.grad).item())
    optimizer.step()
    weights.append(full(model.state_dict()["layer.weight"]).item())
report.update(
    grads=grads,
    weights=weights,
    forward_restored="forward" not in net.__dict__,
    forward_output=full(model(torch.ones(1, 1))).item(),
)
out_dir.mkdir(parents=True, exist_ok=True)
(out_dir / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))
