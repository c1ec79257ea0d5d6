"""A job whose rank 1 is killed by a signal: ``python killed_rank.py STRATEGY SIGNAL_NAME [WHILE]`` (ddp or
ddp_spawn). WHILE says what rank 0 does meanwhile: ``working`` (the default: it sleeps) or ``in-barriers`` (it
waits for rank 1 in barrier after barrier, so it loses rank 1 mid-collective)."""

import os
import signal
import sys
import time

from fabric import Fabric


def work(fabric: Fabric, signal_name: str, meanwhile: str) -> None:
    fabric.barrier()
    if fabric.global_rank == 1:
        os.kill(os.getpid(), signal.Signals[signal_name])
    if meanwhile == "in-barriers":
        for _ in range(600):
            fabric.barrier()
    time.sleep(60)  # rank 0 works on until the launcher stops it


if __name__ == "__main__":
    meanwhile = sys.argv[3] if len(sys.argv) > 3 else "working"
    Fabric(accelerator="cpu", strategy=sys.argv[1], devices=2).launch(work, sys.argv[2], meanwhile)
