"""moto's S3 API server on 127.0.0.1 (in memory) for the benchmarks that write to an object store: started with
the benchmark's buckets, its endpoint and test credentials put in this process's environment (which the benchmark's
jobs inherit), stopped when the block ends."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

SERVER = Path(__file__).resolve().parents[1] / "tests" / "scripts" / "s3_server.py"


@contextlib.contextmanager
def s3_api(*buckets: str) -> Iterator[str]:
    """The server's endpoint, with ``buckets`` made, while the block runs."""
    server = subprocess.Popen(
        [sys.executable, str(SERVER), "127.0.0.1", *buckets],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert server.stdin is not None and server.stdout is not None
    try:
        endpoint = f"http://127.0.0.1:{server.stdout.readline().strip()}"
        os.environ.update(
            AWS_ENDPOINT_URL=endpoint,
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_DEFAULT_REGION="us-east-1",
            AWS_EC2_METADATA_DISABLED="true",
        )
        yield endpoint
    finally:
        server.stdin.close()
        server.wait(timeout=30)
