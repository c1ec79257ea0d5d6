"""How a benchmark runs one configuration as a fresh job and reads its result: the job prints one line
``PREFIX {json}`` (:func:`print_result`, on rank 0), the benchmark finds it in the job's output
(:func:`run_for_result`). A fresh job per configuration keeps each one's peak memory and process group its own."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from typing import Any

#: The launcher's variables, dropped from a job's environment: a benchmark started under a launcher still starts
#: its jobs fresh.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


def print_result(prefix: str, result: dict[str, Any]) -> None:
    print(prefix + json.dumps(result), flush=True)


def run_for_result(
    command: Sequence[str], prefix: str, timeout: float = 900, env: dict[str, str] | None = None
) -> dict[str, Any] | str:
    """Run ``command``; the JSON of its ``prefix`` line, or why there was none (the exit code and last error line)."""
    environment = env if env is not None else dict(os.environ)
    environment = {key: value for key, value in environment.items() if key not in LAUNCHER_VARIABLES}
    done = subprocess.run(list(command), capture_output=True, text=True, env=environment, timeout=timeout, check=False)
    for line in done.stdout.splitlines():
        if line.startswith(prefix):
            return json.loads(line[len(prefix) :])  # type: ignore[no-any-return]
    return f"failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:] or ''}"
