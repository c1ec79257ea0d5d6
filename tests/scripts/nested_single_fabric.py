"""2 CPU ranks launched in-script; after training, rank 0 builds ``Fabric(devices=1)`` of its own and runs the
model's weights through it (litgpt merges LoRA weights so at the end of ``finetune_lora --devices 2``). Each rank
writes what it saw.

Usage: ``python nested_single_fabric.py OUT_DIR``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

from fabric import Fabric


def main(out_dir: Path) -> None:
    fabric = Fabric(accelerator="cpu", devices=2)
    fabric.launch()
    report: dict[str, object] = {"world_size": fabric.world_size}
    if fabric.global_rank == 0:
        single = Fabric(accelerator="cpu", devices=1)
        torch.manual_seed(0)
        model = single.setup(nn.Linear(3, 2))
        report["nested"] = {
            "strategy": type(single.strategy).__name__,
            "world_size": single.world_size,
            "global_rank": single.global_rank,
            "output": model(torch.ones(1, 3)).tolist(),
        }
    fabric.barrier()  # the world the first Fabric joined still works
    (out_dir / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
