"""A real MLflow tracking server for tests, and a proxy in front of it that can stop answering (an outage).

``mlflow_server`` (module) starts ``mlflow server`` on 127.0.0.1 with a SQLite store (its handlers need pandas,
in ``[test]``) and stops its process group at the end. ``OutageProxy`` forwards every request to it; while
:meth:`OutageProxy.hold` is in effect it answers nothing (each request waits until :meth:`OutageProxy.release`), as
a tracking server behind a failing load balancer does. Without the packages the test is skipped, and fails under
``CI=true``.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from engines import require_modules

from fabric.plugins.environments import find_free_port

START_TIMEOUT = 120.0  # the server imports MLflow's whole tracking stack: about 12 s on an idle 2-core machine


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a running MLflow tracking server."""
    require_modules("an MLflow tracking server", "mlflow", "pandas", "flask", "uvicorn")
    folder = tmp_path_factory.mktemp("mlflow-server")
    port = find_free_port()
    url = f"http://127.0.0.1:{port}"
    with open(folder / "server.log", "w") as log:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port)),
                *("--workers", "1", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            start_new_session=True,
        )
    try:
        _wait_until_healthy(url, process, folder / "server.log")
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _wait_until_healthy(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    """Return once ``/health`` answers; fail with the server's log if it exits or does not answer in time."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"mlflow server exited with {process.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            process_wait(process, 0.2)
    pytest.fail(f"mlflow server did not answer within {START_TIMEOUT} s: {log.read_text()[-3000:]}")


def process_wait(process: subprocess.Popen[bytes], seconds: float) -> None:
    """Wait up to ``seconds`` for ``process`` to exit (a pause between health checks that ends early if it dies)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(seconds)


class OutageProxy:
    """An HTTP proxy on 127.0.0.1 to ``upstream`` that holds every request while an outage lasts."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self._answering = threading.Event()
        self._answering.set()
        #: Requests that arrived during an outage.
        self.held = 0
        self._held_one = threading.Event()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                proxy._forward(self)

            def do_POST(self) -> None:
                proxy._forward(self)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def hold(self) -> None:
        """From now on, answer nothing until :meth:`release`."""
        self._answering.clear()

    def wait_for_held(self, timeout: float) -> bool:
        """Whether a request arrived during the outage within ``timeout`` seconds."""
        return self._held_one.wait(timeout)

    def release(self) -> None:
        """End the outage: the held requests go through."""
        self._answering.set()

    def close(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()

    def _forward(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        body = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
        if not self._answering.is_set():
            self.held += 1
            self._held_one.set()
            self._answering.wait()
        request = urllib.request.Request(
            self.upstream + handler.path,
            data=body if handler.command == "POST" else None,
            method=handler.command,
            headers={name: value for name, value in handler.headers.items() if name.lower() == "content-type"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                status, content = answer.status, answer.read()
        except urllib.error.HTTPError as error:
            status, content = error.code, error.read()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(content)))
        handler.end_headers()
        handler.wfile.write(content)
