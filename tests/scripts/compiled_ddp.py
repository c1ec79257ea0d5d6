"""A compiled model on 2 DDP ranks: ``python compiled_ddp.py OUT_DIR``.

``fabric.setup(torch.compile(model, backend=counting))``: each rank records how many graphs the backend
compiled, the gradient after one ``fabric.backward`` on its own input (rank 0: 1.0, rank 1: 3.0, so the
mean is 2.0) and the model's state dict keys, in ``OUT_DIR/rank{R}.json``.
"""

import json
import sys
from pathlib import Path

import torch
from torch import nn

from fabric import Fabric

graphs: list[int] = []


def counting(graph: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
    graphs.append(len(graph.graph.nodes))
    return graph.forward


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1, bias=False)
        nn.init.ones_(self.layer.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.layer(x))


fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
fabric.launch()
net = Net()
model = fabric.setup(torch.compile(net, backend=counting))
fabric.backward(model(torch.tensor([[1.0 + 2 * fabric.global_rank]])).sum())
report = {"graphs": len(graphs), "grad": net.layer.weight.grad.item(), "keys": list(model.state_dict())}
out_dir = Path(sys.argv[1])
out_dir.mkdir(parents=True, exist_ok=True)
(out_dir / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))
