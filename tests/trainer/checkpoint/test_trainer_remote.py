"""Trainer checkpoints on a real S3 API (moto's server, s3fs), with 2 CPU ranks and across two "nodes".

Every strategy resumes bit-exactly from a bucket; a sharded checkpoint is complete only when every rank's part
is there (two nodes with their own disks, a rank killed mid-save); remote saves leave no staged copies behind.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from engines import NodePair, launcher_environment
from object_store import S3Server

from fabric.trainer.checkpoint.preemption import PREEMPTED_EXIT_CODE

#: Slow: Trainer resumes through a real S3 API server on DDP, FSDP and DeepSpeed ranks
#: (`bash scripts/test.sh --end-to-end`; CI runs it).
pytestmark = pytest.mark.end_to_end

SCRIPT = str(Path(__file__).parents[2] / "scripts" / "trainer_sharded.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
STRATEGIES = ["ddp", "fsdp", "deepspeed_stage_2"]
#: What a job must not inherit from the test process (its own rank variables).
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def _environment(server: S3Server, **extra: str) -> dict[str, str]:
    return {k: v for k, v in server.environment(extra).items() if k not in RANK_VARIABLES}


def _run(
    server: S3Server, strategy: str, folder: str, duration: str, out: Path, options: Sequence[str] = (), **extra: str
) -> Any:
    result = subprocess.run(
        [sys.executable, SCRIPT, strategy, folder, duration, str(out), *options],
        env=_environment(server, **extra),
        capture_output=True,
        text=True,
        timeout=600,
    )
    return result


def _train(
    server: S3Server, strategy: str, folder: str, duration: str, out: Path, options: Sequence[str] = (), **extra: str
) -> dict[str, Any]:
    result = _run(server, strategy, folder, duration, out, options, **extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out, weights_only=True)  # type: ignore[no-any-return]


def _same_weights(first: dict[str, Any], second: dict[str, Any]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(first["weights"], second["weights"], strict=True))


def _objects(url: str) -> list[str]:
    """Every object under ``url``, relative to it."""
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return sorted(path[len(root) + 1 :] for path in fs.find(root))


@pytest.mark.parametrize(
    ("strategy", "save_async"), [*((strategy, False) for strategy in STRATEGIES), ("ddp", True), ("fsdp", True)]
)
def test_training_resumes_bit_identically_from_a_bucket(
    strategy: str,
    save_async: bool,
    s3_server: S3Server,
    s3_bucket: str,
    tmp_path: Path,
    sharded_reference: Callable[[str], dict[str, Any]],
) -> None:
    """FSDP's autoresume from s3:// failed with "'.../ep1-ba15-rank0.pt' is a directory, not a checkpoint file".
    Saves written in the background (``save_async``) resume the same."""
    options = [f"save_async={int(save_async)}"]
    straight = sharded_reference(strategy)
    first = _train(s3_server, strategy, f"{s3_bucket}/run", "2ep", tmp_path / "first.pt", options)
    resumed = _train(s3_server, strategy, f"{s3_bucket}/run", "4ep", tmp_path / "resumed.pt", options)
    assert (first["batch"], resumed["started_at"], resumed["batch"]) == (8, 8, 16)
    assert _same_weights(resumed, straight)
    assert not _same_weights(first, straight)
    objects = _objects(f"{s3_bucket}/run")
    assert "latest-rank0.pt.symlink" in objects
    assert not [name for name in objects if ".tmp-" in name]


def test_a_two_rank_fsdp_checkpoint_in_a_bucket_loads_in_one_process_with_storage_options(
    s3_server: S3Server, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resharding 2 -> 1 from S3, the endpoint and credentials given as fsspec storage_options (no variables)."""
    from fabric import Fabric

    first = _train(s3_server, "fsdp", f"{s3_bucket}/run", "2ep", tmp_path / "first.pt")
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    fsspec.filesystem("s3").clear_instance_cache()
    path = f"{s3_bucket}/run/ep2-ba8-rank0.pt"
    with pytest.raises(Exception):  # noqa: B017 - without the options s3fs has no endpoint or credentials
        Fabric(accelerator="cpu").load(path)
    raw = Fabric(accelerator="cpu").load(path, storage_options=s3_server.storage_options())
    weights = [raw["model"][name] for name in ("net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias")]
    assert all(torch.equal(ours, saved) for ours, saved in zip(weights, first["weights"], strict=True))
    assert set(raw["optimizer_0"]) == {"state", "param_groups"}


def test_a_rank_killed_while_writing_its_shard_leaves_the_previous_checkpoint_latest(
    s3_server: S3Server, s3_bucket: str, tmp_path: Path, sharded_reference: Callable[[str], dict[str, Any]]
) -> None:
    """Rank 1 dies mid-upload of the second save: that save is never complete, never resumed from, and the next
    run redoes it over the unfinished directory."""
    folder = f"{s3_bucket}/run"
    killed = _run(s3_server, "fsdp", folder, "4ep", tmp_path / "killed.pt", KILL_RANK_AT_SAVE="1:2")
    assert killed.returncode != 0
    objects = _objects(folder)
    assert "ep1-ba4-rank0.pt/.metadata" in objects
    assert "ep2-ba8-rank0.pt/.metadata" not in objects  # rank 0's shard may be there: the save is unfinished
    fs, _ = fsspec.core.url_to_fs(folder)
    assert fs.cat(f"{folder}/latest-rank0.pt.symlink") == b"ep1-ba4-rank0.pt"

    straight = sharded_reference("fsdp")
    resumed = _train(s3_server, "fsdp", folder, "4ep", tmp_path / "resumed.pt")
    assert (resumed["started_at"], resumed["batch"]) == (4, 16)
    assert _same_weights(resumed, straight)
    redone = _objects(folder)
    assert "ep2-ba8-rank0.pt/.metadata" in redone
    assert any(re.fullmatch(r"ep2-ba8-rank0\.pt/__1_[0-9a-f]+_0\.distcp", name) for name in redone)


def test_remote_one_file_saves_leave_no_staged_copies(s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    """Staged copies stayed in the temp dir after every run (a whole one after a crash), in a directory named by
    the run name only. Now each process stages in its own directory, deletes each copy once uploaded, deletes
    its directory at the end, and a later run deletes what a killed one left."""
    temp = tmp_path / "tmp"
    abandoned = (
        temp
        / "fabric-checkpoint-staging"
        / f".sharded.staging-{_finished_pid()}-{uuid.uuid4().hex}@{socket.gethostname()}"
    )
    abandoned.mkdir(parents=True)
    (abandoned / "ep9-ba99-rank0.pt").write_bytes(b"a staged copy a killed run left")
    long_ago = time.time() - 2 * 3600
    os.utime(abandoned, (long_ago, long_ago))
    _train(s3_server, "ddp", f"{s3_bucket}/run", "2ep", tmp_path / "out.pt", TMPDIR=str(temp))
    assert list((temp / "fabric-checkpoint-staging").iterdir()) == []
    assert _objects(f"{s3_bucket}/run") == ["ep1-ba4-rank0.pt", "ep2-ba8-rank0.pt", "latest-rank0.pt.symlink"]


def _finished_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# --- two "nodes", each with its own temporary directory -----------------------------------------------------


def _two_node_commands(nodes: NodePair, folder: str, out: Path, port: int) -> list[list[str]]:
    endpoint = f"{nodes.address(0)}:{port}"
    return [
        nodes.command(
            node,
            [*TORCHRUN, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
             "--rdzv-id=fabric-test", f"--local-addr={nodes.address(node)}",
             *(["--rdzv-conf=is_host=true"] if node == 0 else []),
             SCRIPT, "fsdp", folder, "2ep", str(out), "devices=1", "num_nodes=2"],
        )
        for node in range(2)
    ]  # fmt: skip


def _run_nodes(commands: list[list[str]], environments: list[dict[str, str]]) -> list[tuple[int, str]]:
    started = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for command, env in zip(commands, environments, strict=True)
    ]
    outputs = [process.communicate(timeout=300) for process in started]
    return [(process.returncode, stderr) for process, (_, stderr) in zip(started, outputs, strict=True)]


def test_two_nodes_with_their_own_temp_dirs_put_every_shard_in_the_bucket(tmp_path: Path) -> None:
    """FSDP on two nodes saving to S3 uploaded only node 0's shard (rank 1's stayed in node B's temp dir), both
    nodes exited 0 and `latest` named a checkpoint with a shard missing. Now every rank writes its shard to the
    bucket and the save completes only with all of them."""
    with NodePair() as nodes:
        server = S3Server(nodes.address(0), tmp_path / "s3.log", prefix=nodes.command(0, [])).start("bucket")
        try:
            environments = [_environment(server, TMPDIR=str(_made(tmp_path / f"tmp-node{node}"))) for node in range(2)]
            results = _run_nodes(_two_node_commands(nodes, "s3://bucket/run", tmp_path / "out.pt", 29541), environments)
            assert [code for code, _ in results] == [0, 0], [stderr[-2000:] for _, stderr in results]
            check = subprocess.run(
                nodes.command(0, [sys.executable, "-c", _LIST_AND_LOAD, "s3://bucket/run"]),
                env=environments[0],
                capture_output=True,
                text=True,
                timeout=120,
            )
        finally:
            server.stop()
    assert check.returncode == 0, check.stderr[-3000:]
    objects, loaded_weights = check.stdout.strip().splitlines()
    for save in ("ep1-ba4-rank0.pt", "ep2-ba8-rank0.pt"):
        parts = [name[len(save) + 1 :] for name in objects.split(",") if name.startswith(f"{save}/")]
        assert ".metadata" in parts
        for rank in range(2):  # each rank's shard, named with the save's generation
            assert any(re.fullmatch(rf"__{rank}_[0-9a-f]+_0\.distcp", part) for part in parts), parts
    trained = torch.load(tmp_path / "out.pt", weights_only=True)
    assert loaded_weights == repr([w.sum().item() for w in trained["weights"]])
    for node in range(2):  # nothing staged or left behind on either node's disk
        assert [p for p in (tmp_path / f"tmp-node{node}").rglob("*") if p.is_file()] == []


_LIST_AND_LOAD = """
import sys
import fsspec
from fabric import Fabric

folder = sys.argv[1]
fs, root = fsspec.core.url_to_fs(folder)
print(",".join(sorted(path[len(root) + 1:] for path in fs.find(root))))
latest = fs.cat(f"{folder}/latest-rank0.pt.symlink").decode()
model = Fabric(accelerator="cpu").load(f"{folder}/{latest}")["model"]
print(repr([model[name].sum().item() for name in ("net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias")]))
"""


def test_two_nodes_saving_sharded_to_their_own_disks_fail_loudly(tmp_path: Path) -> None:
    """A local save_folder that is not shared between the nodes: each node wrote its own shards, and node 0
    published a checkpoint missing node 1's. Now the save fails on every rank, naming the missing shard."""
    shared = _made(tmp_path / "checkpoints")
    private = _made(tmp_path / "node1-disk")
    with NodePair() as nodes:
        commands = _two_node_commands(nodes, str(shared), tmp_path / "out.pt", 29542)
        # node 1 sees its own disk at the same path
        commands[1] = nodes.command(
            1, ["sh", "-c", f'mount --bind {private} {shared} && exec "$@"', "sh", *commands[1][4:]]
        )
        environment = {k: v for k, v in launcher_environment().items() if k not in RANK_VARIABLES}
        results = _run_nodes(commands, [environment, environment])
    assert all(code != 0 for code, _ in results), [stderr[-2000:] for _, stderr in results]
    assert "__1_0.distcp" in results[0][1] and "storage every node shares" in results[0][1]
    assert not [name for name in os.listdir(shared) if name.startswith("ep")]  # nothing published
    assert not os.path.lexists(shared / "latest-rank0.pt")


def _made(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.mark.parametrize(
    ("launch", "options"),
    [(["--devices", "1"], []), (["--devices", "2"], []), (["--devices", "2"], ["strategy=fsdp"])],
    ids=["1-rank", "ddp-2-ranks", "fsdp-2-ranks"],
)
def test_sigterm_saves_to_the_bucket_and_the_next_run_resumes_from_it(
    launch: list[str], options: list[str], s3_server: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    script = str(Path(SCRIPT).parent / "trainer_resume.py")
    command = [sys.executable, "-m", "fabric_cli", "run", "model", *launch, "--run-dir", str(tmp_path / "run")]
    folder = f"{s3_bucket}/ckpt"
    job = subprocess.Popen(
        [*command, script, folder, "100000", "10000ba", *options],
        env=_environment(s3_server),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert job.stdout is not None
    assert job.stdout.readline().startswith("training"), job.communicate(timeout=60)  # rank 0 is in fit()
    job.send_signal(signal.SIGTERM)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == PREEMPTED_EXIT_CODE, stderr[-3000:]
    saved = [name for name in _objects(f"{folder}/job") if name.startswith("ep0-ba")]
    assert saved, _objects(folder)
    resumed = subprocess.run(
        [*command, script, folder, "0", "10000ba", *options],
        env=_environment(s3_server),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.startswith("resumed at batch "), resumed.stdout
    latest = fsspec.core.url_to_fs(folder)[0].cat(f"{folder}/job/latest-rank0.pt.symlink").decode()
    assert latest == f"ep0-ba{resumed.stdout.split()[3]}-rank0.pt"
