"""A job whose rank 1 is killed by a signal: ``python killed_rank.py STRATEGY SIGNAL_NAME`` (ddp or ddp_spawn)."""

import os
import signal
import sys
import time

from fabric import Fabric


def work(fabric: Fabric, signal_name: str) -> None:
    fabric.barrier()
    if fabric.global_rank == 1:
        os.kill(os.getpid(), signal.Signals[signal_name])
    time.sleep(60)  # rank 0 works on until the launcher stops it


if __name__ == "__main__":
    Fabric(accelerator="cpu", strategy=sys.argv[1], devices=2).launch(work, sys.argv[2])
