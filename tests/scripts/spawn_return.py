"""``launch(fn)`` with a spawn/fork strategy: prints what rank 0 returned. ``python spawn_return.py STRATEGY [MODE]``

MODE ``sum`` (default) returns a small dict with a tensor; ``large`` returns a 16 MB tensor (more than a pipe
holds); ``rank1_raises`` makes rank 1 raise while rank 0 sleeps for 10 minutes, so only stopping it ends the job.
"""

import sys
import time

import torch

from fabric import Fabric


def work(fabric: Fabric, offset: int, mode: str) -> object:
    if mode == "large":
        return torch.full((4, 1024, 1024), float(fabric.global_rank + offset))
    if mode == "rank1_raises":
        if fabric.global_rank == 1:
            raise ValueError("rank 1 fails on purpose")
        time.sleep(600)
    total = fabric.all_reduce(torch.tensor(float(fabric.global_rank + offset)), reduce_op="sum")
    return {"rank": fabric.global_rank, "world": fabric.world_size, "total": total}


if __name__ == "__main__":
    mode = sys.argv[2] if len(sys.argv) > 2 else "sum"
    fabric = Fabric(accelerator="cpu", strategy=sys.argv[1], devices=2)
    result = fabric.launch(work, 10, mode)
    if mode == "large":
        print(f"shape={tuple(result.shape)} values={result.unique().tolist()}")
    else:
        total = result["total"]
        print(f"rank={result['rank']} world={result['world']} total={total.item()} type={type(total).__name__}")
