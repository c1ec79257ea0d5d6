"""``launch(fn)`` with a spawn/fork strategy: prints what rank 0 returned. ``python spawn_return.py STRATEGY``"""

import sys

import torch

from fabric import Fabric


def work(fabric: Fabric, offset: int) -> dict:
    total = fabric.all_reduce(torch.tensor(float(fabric.global_rank + offset)), reduce_op="sum")
    return {"rank": fabric.global_rank, "world": fabric.world_size, "total": total}


if __name__ == "__main__":
    fabric = Fabric(accelerator="cpu", strategy=sys.argv[1], devices=2)
    result = fabric.launch(work, 10)
    total = result["total"]
    print(f"rank={result['rank']} world={result['world']} total={total.item()} type={type(total).__name__}")
