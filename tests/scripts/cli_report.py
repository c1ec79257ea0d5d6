"""Reports what a plain ``Fabric()`` resolved under the CLI: ``cli_report.py OUT_DIR [ARGS...]``.

``--fail-rank R`` makes rank R exit 7, ``--hang`` keeps every rank waiting, ``--ignore-term`` ignores SIGTERM.
"""

import json
import os
import signal
import sys
from pathlib import Path

from fabric import Fabric

if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
fabric = Fabric()
fabric.launch()
report = {
    "rank": fabric.global_rank,
    "local_rank": fabric.local_rank,
    "node_rank": fabric.node_rank,
    "world_size": fabric.world_size,
    "num_nodes": getattr(fabric.strategy, "num_nodes", 1),
    "strategy": type(fabric.strategy).__name__,
    "precision": fabric.precision.name,
    "args": sys.argv[2:],
    "pid": os.getpid(),
    "env": {
        name: os.environ.get(name)
        for name in ("FABRIC_RUN_DIRECTORY", "PYTHONUNBUFFERED", "MASTER_PORT", "GLOO_SOCKET_IFNAME")
    },
    "sum": fabric.all_reduce(fabric.global_rank + 1, reduce_op="sum").item(),
}
print(f"rank {fabric.global_rank} reporting", flush=True)
Path(sys.argv[1], f"rank{fabric.global_rank}.json").write_text(json.dumps(report))
if "--fail-rank" in sys.argv and str(fabric.global_rank) == sys.argv[sys.argv.index("--fail-rank") + 1]:
    print("failing on purpose", file=sys.stderr)
    sys.exit(7)
if "--hang" in sys.argv:
    import time

    for _ in range(600):
        time.sleep(0.1)
