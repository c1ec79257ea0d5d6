"""Started by ``fabric run model --mesh ...``: a plain ``Fabric()`` shards a layer; each rank writes what it got."""

import json
import sys
from pathlib import Path

import torch

from fabric import Fabric

fabric = Fabric()
fabric.launch()
layer = fabric.setup_module(torch.nn.Linear(4, 8))
report = {
    "strategy": type(fabric.strategy).__name__,
    "mesh": fabric.strategy.mesh_plan().as_text(),  # type: ignore[attr-defined]
    "placements": [str(placement) for placement in layer.module.weight.placements],
    "local_rows": layer.module.weight.to_local().shape[0],
    "data_parallel_shard": list(fabric.strategy.data_parallel_shard),  # type: ignore[attr-defined]
}
(Path(sys.argv[1]) / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))
