"""S3 requests against an endpoint that accepts connections and never answers (a "black hole" on 127.0.0.1): a save
fails within its bounds, names what it waited for on stderr while waiting, and never reports the bucket missing."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
import torch
from engines import require_modules
from object_store import CREDENTIALS

from fabric import Fabric
from fabric.plugins.io import s3_requests
from fabric.plugins.io.storage import filesystem, fsspec_options
from fabric.utilities.exceptions import CheckpointError


@pytest.fixture
def black_hole(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An endpoint URL whose server accepts every connection and never sends a byte."""
    require_modules("S3 requests", "s3fs")
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    server = socket.create_server(("127.0.0.1", 0), backlog=64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()
    for connection in held:
        connection.close()


def _options(endpoint: str) -> dict[str, object]:
    """One attempt per call with a one-second read timeout, so that each call (5 tries by s3fs) ends in seconds."""
    config = {"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1}}
    return {"client_kwargs": {"endpoint_url": endpoint}, "config_kwargs": config}


@pytest.mark.end_to_end  # waits out a real timeout against a silent endpoint: scripts/test.sh --end-to-end
def test_a_save_to_an_endpoint_that_never_answers_fails_naming_the_wait_and_the_timeout(
    black_hole: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """s3fs's exists() took the timeouts for "no such bucket", and nothing was said while it waited."""
    monkeypatch.setattr(s3_requests, "NOTICE_AFTER_S", 0.2)  # well inside the one-second read timeout
    fabric = Fabric(accelerator="cpu", devices=1)
    with pytest.raises(CheckpointError) as error:
        fabric.save("s3://run-bucket/ckpt.pt", {"weights": torch.ones(3)}, storage_options=_options(black_hole))
    assert str(error.value).startswith(
        "Cannot save to 's3://run-bucket/ckpt.pt': the bucket 'run-bucket' could not be checked: ReadTimeoutError"
    )
    assert "does not exist" not in str(error.value)
    stderr = capfd.readouterr().err
    assert f" {black_hole}/run-bucket" in stderr and "has had no answer for 0 s; still waiting" in stderr
    assert "storage_options={'config_kwargs'" in stderr


@pytest.mark.end_to_end  # waits out a real timeout against a silent endpoint: scripts/test.sh --end-to-end
def test_an_upload_to_an_endpoint_that_never_answers_ends_at_its_read_timeout(black_hole: str) -> None:
    """botocore asks for ``Expect: 100-continue`` and aiohttp waits for that answer with no timeout: the upload
    hung for ever (killed after 120 s here)."""
    fs, path = filesystem("s3://run-bucket/ckpt.pt", _options(black_hole))
    outcome: list[BaseException] = []

    def upload() -> None:
        try:
            fs.pipe_file(path, b"checkpoint bytes")
        except BaseException as error:
            outcome.append(error)

    uploading = threading.Thread(target=upload, daemon=True)
    uploading.start()
    uploading.join(timeout=120)
    assert not uploading.is_alive(), "the upload still waits for an endpoint that never answers"
    assert [type(error).__name__ for error in outcome] == ["ReadTimeoutError"]


def test_storage_options_keep_what_they_set_and_get_bounds_for_the_rest() -> None:
    require_modules("S3 requests", "s3fs")
    options = fsspec_options("s3://bucket/ckpt", {"config_kwargs": {"read_timeout": 99}, "anon": False})
    assert options["config_kwargs"] == {**s3_requests.DEFAULT_CONFIG, "read_timeout": 99}
    assert options["anon"] is False and options["session"] is not None
    own = object()
    assert fsspec_options("s3://bucket/ckpt", {"session": own})["session"] is own
    assert fsspec_options("memory://bucket/ckpt", {"x": 1}) == {"x": 1}  # only s3fs gets them
    assert fsspec_options("/local/ckpt", None) == {}
