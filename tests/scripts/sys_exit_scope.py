"""``python sys_exit_scope.py OUT_DIR``: a two-rank ``python train.py`` job; each rank writes ``rank<N>.txt`` from an
exit handler that runs after Fabric's: whether ``sys.exit`` was replaced during the job, and whether it is the
interpreter's own again at the end."""

import atexit
import sys
from pathlib import Path

from fabric import Fabric

interpreters_exit = sys.exit
out_dir = Path(sys.argv[1])
fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)


def report() -> None:
    own_again = sys.exit is interpreters_exit
    (out_dir / f"rank{rank}.txt").write_text(f"replaced during the job: {replaced}, own again: {own_again}")


atexit.register(report)  # before launch(): exit handlers run last-registered first, so this one runs after Fabric's
fabric.launch()
rank, replaced = fabric.global_rank, sys.exit is not interpreters_exit
fabric.barrier()
