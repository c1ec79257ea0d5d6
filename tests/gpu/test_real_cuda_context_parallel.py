"""Context parallelism on a real CUDA GPU: torch's ``context_parallel`` (ring attention on the flash or
memory-efficient kernel, its load-balanced split of the sequences) through Fabric's loop, against one process training
the same causal transformer on the whole sequences on the same GPU (tests/scripts/context_parallel_gpu_job.py).

The lent machines have one GPU, and with ``context_parallel=1`` Fabric never enters torch's ``context_parallel`` (the
context changes nothing: a one-process run would prove nothing), while NCCL refuses two ranks on one GPU. So two
processes share the GPU over gloo, which carries CUDA tensors through pinned host copies for every collective of the
run (ring attention's all-gather and all-to-all, FSDP2's all-gather and reduce-scatter): started with torchrun's
variables as two nodes of one GPU each, both on ``cuda:0``. The loss of an untrained model hardly depends on
attention (measured on CPU with the halves attending only to themselves: losses within 6e-4 of the reference's, but
first-step gradients 3-84% away), so the gradients carry the proof. Skipped without a GPU (``tests/conftest.py``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cuda

SCRIPT = Path(__file__).parents[1] / "scripts" / "context_parallel_gpu_job.py"
LENGTH = 64  # the job's sequence length: each of the 2 ranks holds 32 positions
#: (loss relative, first-step gradients as the largest relative norm error of a parameter, weights after 3 AdamW
#: steps at lr 1e-2 absolute or None): float32 differs by reduction order only; bfloat16 by its rounding (8 bits).
TOLERANCES = {"32-true": (1e-5, 1e-4, 1e-4), "bf16-true": (2e-2, 5e-2, None)}
#: torchrun's variables, replaced for each rank
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _environment() -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES}
    root = str(Path(__file__).parents[2])
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [root, environment.get("PYTHONPATH")]))
    return environment


def _reference(out: Path, precision: str) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), precision, "reference"],
        capture_output=True,
        text=True,
        timeout=300,
        env=_environment(),
    )
    assert done.returncode == 0, done.stderr[-4000:]


def _two_ranks_on_one_gpu(out: Path, precision: str) -> None:
    """Rank 0 and rank 1 as torchrun would start them on two nodes of one GPU each, the nodes being this machine."""
    port = str(_free_port())
    ranks = []
    for rank in range(2):
        variables = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2"}
        variables |= {"RANK": str(rank), "GROUP_RANK": str(rank), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
        log = (out / f"rank{rank}-{precision}.log").open("w")
        command = [sys.executable, str(SCRIPT), str(out), precision, "train"]
        ranks.append(
            (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_environment() | variables), log)
        )
    try:
        codes = [process.wait(timeout=300) for process, _ in ranks]
    finally:
        for process, log in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()
    logs = "\n".join((out / f"rank{rank}-{precision}.log").read_text()[-3000:] for rank in range(2))
    assert codes == [0, 0], logs


def _relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).norm() / theirs.norm())


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_ring_attention_over_two_ranks_trains_like_one_process_on_the_whole_sequence(
    precision: str, tmp_path: Path
) -> None:
    if precision == "bf16-true" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    _reference(tmp_path, precision)
    _two_ranks_on_one_gpu(tmp_path, precision)
    report = torch.load(tmp_path / f"train-{precision}.pt")
    reference = torch.load(tmp_path / f"reference-{precision}.pt")
    loss_tolerance, gradient_tolerance, weight_tolerance = TOLERANCES[precision]

    # the run really was context-parallel on the GPU: 2 ranks of one group over gloo, FSDP over the flattened dimension
    assert (report["device"], report["backend"]) == ("cuda:0", "gloo")
    assert report["mesh"] == {"data_parallel": 1, "context_parallel": 2, "tensor_parallel": 1}
    assert report["shard_meshes"] == {("data_parallel_context_parallel",)}
    # inside the context each rank held half of every sequence (tokens, targets, positional buffer: restored after)
    assert report["seen"] == [[(4, LENGTH // 2), (4, LENGTH // 2), (LENGTH // 2, 64)]] * 3
    assert report["restored"] == (LENGTH, 64)
    # torch's split: the two ranks' positions are the whole sequence, and each rank's tokens are those positions'
    held = [part["positions"] for part in report["parts"]]
    assert sorted(held[0] + held[1]) == list(range(LENGTH)), held
    assert all(part["tokens_match"] for part in report["parts"]), report["parts"]

    assert report["losses"] == pytest.approx(reference["losses"], rel=loss_tolerance)
    assert sorted(report["gradients"]) == sorted(reference["gradients"])
    errors = {name: _relative_error(report["gradients"][name], value) for name, value in reference["gradients"].items()}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] < gradient_tolerance, f"{worst}: {errors[worst]:.2e} (every parameter: {errors})"
    if weight_tolerance is not None:
        for name, value in reference["weights"].items():
            difference = (report["weights"][name] - value).abs().max().item()
            assert difference < weight_tolerance, f"{name}: {difference:.2e}"
