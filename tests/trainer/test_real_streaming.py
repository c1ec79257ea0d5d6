"""Real MDS shards through mosaicml-streaming's ``StreamingDataset`` and ``StreamingDataLoader`` and the Trainer:
2 ranks crash mid-epoch, resume on 1 and on 2 ranks, and every epoch trains each sample once.

mosaicml-streaming cannot share the test environment (it pins numpy and transformers and pulls a CUDA torch), so
this runs in the environment ``bash scripts/streaming_env.sh`` makes (``.venv-streaming``, or the interpreter named
by ``FABRIC_STREAMING_PYTHON``) and is skipped without it, like Ray's test. ``tests/test_trainer_streaming.py``
covers the same behaviour in the main suite with a stand-in of the same API.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from test_trainer_streaming import RANK_VARIABLES, SCRIPT, TESTS, _assert_each_sample_once_per_epoch

REPOSITORY = TESTS.parent
PYTHON = Path(os.environ.get("FABRIC_STREAMING_PYTHON", REPOSITORY / ".venv-streaming" / "bin" / "python"))

pytestmark = pytest.mark.skipif(
    not PYTHON.exists(), reason="mosaicml-streaming is optional: bash scripts/streaming_env.sh makes its environment"
)


def _run(*arguments: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(REPOSITORY)])
    return subprocess.run([str(PYTHON), str(SCRIPT), *arguments], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("after", [1, 2])
def test_real_shards_resume_mid_epoch_with_every_sample_once_per_epoch(after: int, tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    written = _run("write", str(shards))
    assert written.returncode == 0, written.stderr[-3000:]
    crashed = _run(str(tmp_path), "2", "11", "first", "mds", str(shards))
    assert crashed.returncode == 17, crashed.stderr[-3000:]
    resumed = _run(str(tmp_path), str(after), "0", "second", "mds", str(shards))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_each_sample_once_per_epoch(tmp_path)
