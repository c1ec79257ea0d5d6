"""Meta-device init with FSDP trains a model whose parameters exceed each rank's memory cap, on 2 CPU ranks
(tests/scripts/fsdp_memory_cap.py explains the cap and the model), while materialising it unsharded
under the same cap fails."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parents[2] / "scripts"

try:
    import resource

    CAN_CAP_ADDRESS_SPACE = hasattr(resource, "RLIMIT_AS") and sys.platform == "linux"
except ImportError:  # Windows
    CAN_CAP_ADDRESS_SPACE = False


@pytest.mark.skipif(
    not CAN_CAP_ADDRESS_SPACE, reason="needs an enforced RLIMIT_AS and /proc/self/status (Linux) to cap memory"
)
def test_meta_init_trains_a_model_larger_than_the_cap_that_refuses_it_unsharded(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env |= {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "1048576"}
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "fsdp_memory_cap.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["cap_over_baseline"] < report["model_bytes"], "the cap must be below the model's size"
        # The cap is real: the unsharded model does not fit, and its failed allocation left nothing behind.
        assert "can't allocate memory" in report["unsharded_error"] or "MemoryError" in report["unsharded_error"]
        assert report["after_unsharded_over_baseline"] < report["model_bytes"] / 16
        # Sharded and materialised under the cap: half of every layer here, and a real training step.
        assert report["local_numel"] * 2 == report["total_numel"]
        assert report["sharded_over_baseline"] <= report["cap_over_baseline"]
        assert math.isfinite(report["loss"]) and report["loss"] > 0
        assert report["trained_changed"] == [True] * 4  # weight and bias of the two trained layers
