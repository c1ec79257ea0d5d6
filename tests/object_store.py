"""A real S3 API for tests: moto's server (``tests/scripts/s3_server.py``) with s3fs as the client.

``s3_server`` (session) serves on 127.0.0.1; ``s3_bucket`` gives each test a new bucket as ``s3://NAME`` and
points this process's clients at the server through the environment (``AWS_ENDPOINT_URL``, test
credentials, and ``AWS_EC2_METADATA_DISABLED=true`` so that nothing probes a cloud metadata address).
Processes a test starts get the same variables from ``S3Server.environment``. ``S3Server`` also runs inside
a network namespace (``prefix=nodes.command(0, [])``) to serve two namespaced "nodes". Without moto or s3fs
a test is skipped, and fails under ``CI=true``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from engines import launcher_environment, require_modules, stop_process

SERVER = Path(__file__).parent / "scripts" / "s3_server.py"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


class S3Server:
    """moto's S3 server on ``address`` (an unused port), started by :meth:`start`, with ``buckets`` made."""

    def __init__(self, address: str, log: Path, prefix: list[str] | None = None) -> None:
        self.address = address
        self.log = log
        self.prefix = prefix or []
        self.port = 0
        self._process: subprocess.Popen[str] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.address}:{self.port}"

    def environment(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """A launched process's environment (see ``launcher_environment``) with this server as its S3 API."""
        return launcher_environment({**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint, **(extra or {})})

    def storage_options(self) -> dict[str, object]:
        """The same endpoint and credentials as fsspec ``storage_options``, for clients without the variables."""
        return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": self.endpoint}}

    def start(self, *buckets: str) -> S3Server:
        require_modules("an S3 API server", "moto", "flask", "s3fs")
        with open(self.log, "a") as log:
            self._process = subprocess.Popen(
                [*self.prefix, sys.executable, str(SERVER), self.address, *buckets],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env={**os.environ, **CREDENTIALS},
            )
        assert self._process.stdout is not None
        line = self._process.stdout.readline().strip()
        if not line.isdigit():
            self.stop()
            raise RuntimeError(f"the S3 server did not start: {self.log.read_text()[-2000:]}")
        self.port = int(line)
        return self

    def create_bucket(self) -> str:
        """A new, empty bucket (from this process); returns ``s3://NAME``."""
        import boto3

        name = f"test-{uuid.uuid4().hex[:16]}"
        boto3.client("s3", endpoint_url=self.endpoint, **_boto_credentials()).create_bucket(Bucket=name)
        return f"s3://{name}"

    def stop(self) -> None:
        if self._process is not None:
            assert self._process.stdin is not None
            self._process.stdin.close()
            stop_process(self._process, grace=5.0)
            self._process = None


def _boto_credentials() -> dict[str, str]:
    return {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server("127.0.0.1", tmp_path_factory.mktemp("s3") / "server.log").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``s3://NAME`` of a new bucket; this process's S3 clients (s3fs, boto3) reach the test server.

    s3fs's cached clients are dropped before and after: one a test made with other settings would be reused.
    """
    import s3fs

    for name, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": s3_server.endpoint}.items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()
    yield s3_server.create_bucket()
    s3fs.S3FileSystem.clear_instance_cache()
