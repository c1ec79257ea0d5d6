"""Ray Train's ``TorchTrainer`` with 2 CPU workers, each running ``launched_world.py OUT_DIR`` with a default
``Fabric()``: ``ray_world.py OUT_DIR``. Ray sets the torch rank variables and joins the process group itself."""

import runpy
import sys
from pathlib import Path

import ray
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer

WORLD = str(Path(__file__).parent / "launched_world.py")
out_dir = sys.argv[1]


def run_world(config: dict) -> None:
    sys.argv = [WORLD, out_dir]
    runpy.run_path(WORLD, run_name="__main__")


ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
TorchTrainer(run_world, scaling_config=ScalingConfig(num_workers=2, use_gpu=False)).fit()
