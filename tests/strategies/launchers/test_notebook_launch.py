"""``Fabric(devices=2)`` then ``fabric.launch(train)`` in a notebook: the launch page's pattern forks the ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from fabric.connector import resolve
from fabric.strategies import DDPStrategy

#: A notebook's cells, run the way a kernel runs them: compiled from a string and exec'd in ``__main__``,
#: with an interactive prompt set and no script file behind them.
_CELLS = [
    """
    import torch
    from fabric import Fabric

    def train(fabric, scale):
        total = fabric.all_reduce(torch.tensor(float(fabric.global_rank + 1)) * scale, reduce_op="sum")
        return {"world": fabric.world_size, "total": total.item(), "strategy": type(fabric.strategy).__name__,
                "start_method": fabric.strategy.start_method}
    """,
    """
    fabric = Fabric(accelerator="cpu", devices=2)
    result = fabric.launch(train, 10.0)
    """,
    """
    import json
    print("RESULT " + json.dumps(result))
    """,
]

_KERNEL = textwrap.dedent(
    """
    import json, sys
    sys.ps1 = ">>> "
    namespace = sys.modules["__main__"].__dict__
    for number, cell in enumerate(json.loads(sys.stdin.read())):
        exec(compile(cell, f"<cell {number}>", "exec"), namespace)
    """
)

_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "FABRIC_CLI_LAUNCHED", "SLURM_JOB_ID")


def test_a_notebook_launches_two_ranks_with_devices_2_and_says_it_forks_once() -> None:
    env = {key: value for key, value in os.environ.items() if key not in _LAUNCHER_VARIABLES}
    cells = json.dumps([textwrap.dedent(cell) for cell in _CELLS])
    result = subprocess.run(
        [sys.executable, "-c", _KERNEL], input=cells, capture_output=True, text=True, timeout=180, env=env
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    assert json.loads(line.removeprefix("RESULT ")) == {
        "world": 2,
        "total": 30.0,  # rank 0's result: (1 + 2) * 10 summed over both forked ranks
        "strategy": "DDPStrategy",
        "start_method": "fork",
    }
    assert result.stderr.count("using strategy='ddp_notebook'") == 1, result.stderr[-4000:]


def test_auto_picks_the_forking_strategy_only_in_an_interactive_session_that_starts_its_own_ranks() -> None:
    with pytest.warns(UserWarning, match=r"with 2 processes in an interactive session .* strategy='ddp_notebook'"):
        notebook = resolve(accelerator="cpu", devices=2, environ={}, interactive=True).strategy
    assert isinstance(notebook, DDPStrategy) and notebook.start_method == "fork"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        script = resolve(accelerator="cpu", devices=2, environ={}).strategy
        launched_env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
        launched = resolve(accelerator="cpu", environ=launched_env, interactive=True).strategy
        single = resolve(accelerator="cpu", devices=1, environ={}, interactive=True).strategy
    assert isinstance(script, DDPStrategy) and script.start_method == "popen"
    assert isinstance(launched, DDPStrategy) and launched.start_method == "popen"  # torchrun started the ranks
    assert type(single).__name__ == "SingleDeviceStrategy"
    named = resolve(accelerator="cpu", devices=2, strategy="ddp", environ={}, interactive=True).strategy
    assert isinstance(named, DDPStrategy) and named.start_method == "popen"  # a named strategy is kept
