"""A sharded (FSDP/DCP) save over the checkpoint already at an object-store URL, on a real S3 API with two ranks:
the previous checkpoint stays loadable until the new one is complete, whatever moment the job is killed at."""

from __future__ import annotations

import posixpath
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
import torch
from object_store import S3Server

from fabric import Fabric
from fabric.plugins.io.distributed_checkpoint import listed_shards

#: Slow: a job killed while overwriting a sharded checkpoint in an S3 API
#: (`bash scripts/test.sh --end-to-end`; CI runs it).
pytestmark = pytest.mark.end_to_end

SCRIPT = str(Path(__file__).parents[2] / "scripts" / "fsdp_remote_overwrite.py")
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def _run(server: S3Server, url: str, out: Path, *options: str) -> subprocess.CompletedProcess[str]:
    out.mkdir(exist_ok=True)
    environment = {k: v for k, v in server.environment().items() if k not in RANK_VARIABLES}
    command = [sys.executable, SCRIPT, url, str(out), *options]
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300, check=False)


def _objects(url: str) -> set[str]:
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return {posixpath.basename(path) for path in fs.find(root)}


def _loads_as(url: str, expected: Path, step: int) -> bool:
    loaded = Fabric(accelerator="cpu").load(url)
    weights = torch.load(expected, weights_only=True)
    return loaded["step"] == step and all(torch.equal(loaded["model"][name], weights[name]) for name in weights)


def test_a_job_killed_while_overwriting_a_remote_sharded_checkpoint_leaves_the_previous_one_loadable(
    s3_server: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    """The save used to delete the checkpoint there first: killed mid-upload, nothing loaded afterwards ("is a
    directory but not a complete checkpoint")."""
    url = f"{s3_bucket}/last"
    killed = _run(s3_server, url, tmp_path / "killed", "kill")
    assert killed.returncode != 0
    assert _loads_as(url, tmp_path / "killed" / "step1.pt", step=1)
    left_by_the_killed_save = _objects(url) - listed_shards(url) - {".metadata"}

    first = listed_shards(url)
    finished = _run(s3_server, url, tmp_path / "finished")
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert _loads_as(url, tmp_path / "finished" / "step2.pt", step=2)
    current = listed_shards(url)
    assert len(current) == 2 and not current & first
    # The replaced checkpoints' shards are gone; what the killed save left stays until it is an hour old (a younger
    # one might belong to a save still being written).
    assert _objects(url) == {".metadata", *current, *left_by_the_killed_save}
