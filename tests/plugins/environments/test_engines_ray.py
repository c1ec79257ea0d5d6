"""Fabric under Ray Train: ``TorchTrainer`` with 2 CPU workers, each a default ``Fabric()``, trains one world.

Optional: Ray is 500 MB and not in ``[test]``; this runs only where ``ray`` is installed (the issue that asked for
it says so), in a network namespace of its own (Ray's processes listen on every address)."""

from __future__ import annotations

from pathlib import Path

import pytest
from engines import launcher_environment, network_namespace, require_namespaces
from worlds import assert_one_world_trained, reports

pytest.importorskip("ray", reason="Ray Train is optional (500 MB): pip install 'ray[train]' to run this test")

RAY_WORLD = str(Path(__file__).parents[2] / "scripts" / "ray_world.py")


def test_ray_train_workers_with_a_default_fabric_train_as_one_world(tmp_path: Path) -> None:
    """Each Ray worker's default Fabric() ran as a world of one, training on all the data, silently."""
    require_namespaces("Ray")
    with network_namespace("ray", veth=False) as namespace:
        environment = launcher_environment({"RAY_USAGE_STATS_ENABLED": "0"})
        result = namespace.run(["python", RAY_WORLD, str(tmp_path)], environment, tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = reports(tmp_path, 2)
    assert_one_world_trained(ranks, 2)
