"""The ``isolated`` marker: a test whose function runs in a forked child process.

So a native crash (a known torch/oneDNN bug on some CPUs, see fabric/trainer/algorithms/channels_last.py)
fails that one test, naming the signal, and the rest of the suite still runs and reports. Fixtures are set
up in the parent; the child inherits them. The child runs torch on one thread: OpenMP's thread pool does
not survive fork (a child using two threads after its parent did hangs). ``tests/conftest.py`` loads
these hooks; ``tests/test_isolation.py`` checks them on a crashing test.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable

import pytest
import torch

ISOLATED_TIMEOUT_SECONDS = 600.0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "isolated: run the test function in a forked child process")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if pyfuncitem.get_closest_marker("isolated") is None:
        return None
    arguments = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    outcome, text = _call_in_child(lambda: pyfuncitem.obj(**arguments))
    if outcome == "skipped":
        pytest.skip(text)
    if outcome != "passed":
        pytest.fail(text, pytrace=False)
    return True


def _call_in_child(test: Callable[[], object]) -> tuple[str, str]:
    """Run ``test`` in a forked child; returns ``("passed" | "failed" | "skipped", report text)``."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, report through the pipe, leave without running the parent's exit code
        os.close(read_end)
        torch.set_num_threads(1)
        try:
            test()
            report = ("passed", "")
        except pytest.skip.Exception as skipped:
            report = ("skipped", str(skipped.msg))
        except BaseException:
            report = ("failed", traceback.format_exc())
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(json.dumps(report).encode())
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(0)
    os.close(write_end)
    received = _read_until_closed(read_end, pid)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        return "failed", f"the test process died from {name} (signal {os.WTERMSIG(status)}): a native crash"
    if received is None:
        return "failed", f"the test process did not finish within {ISOLATED_TIMEOUT_SECONDS:.0f} s and was killed"
    if not received:
        return "failed", f"the test process exited with code {os.WEXITSTATUS(status)} before reporting"
    outcome, text = json.loads(received)
    return outcome, text


def _read_until_closed(read_end: int, pid: int) -> bytes | None:
    """Everything the child writes until it closes the pipe; None (and the child killed) past the timeout."""
    deadline = time.monotonic() + ISOLATED_TIMEOUT_SECONDS
    chunks = []
    with os.fdopen(read_end, "rb") as pipe:
        while True:
            ready, _, _ = select.select([pipe], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                return None
            chunk = pipe.read1(65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
