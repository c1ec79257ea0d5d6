"""Distributed pieces that need no second process: data sharding, strategy wiring, launch rules."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, Sampler, TensorDataset

from fabric import Fabric
from fabric.accelerators import CPUAccelerator
from fabric.plugins.environments import LocalEnvironment, TorchElasticEnvironment
from fabric.plugins.precision import Precision
from fabric.strategies.ddp import DDPStrategy
from fabric.utilities.data import ShardedSampler, shard_dataloader

DATA = TensorDataset(torch.arange(10))


def _indices(loader: DataLoader) -> list[int]:
    return [int(i) for batch in loader for i in batch[0]]


@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_are_disjoint_cover_the_data_and_keep_the_loader_settings(shuffle: bool) -> None:
    loader = DataLoader(DATA, batch_size=2, shuffle=shuffle, drop_last=False)
    shards = [shard_dataloader(loader, num_replicas=2, rank=rank) for rank in range(2)]
    first, second = (_indices(shard) for shard in shards)
    assert not set(first) & set(second)
    assert sorted(first + second) == list(range(10))
    assert all(isinstance(shard.sampler, DistributedSampler) for shard in shards)
    assert shards[0].sampler.shuffle is shuffle  # type: ignore[attr-defined]
    assert shards[0].batch_size == 2 and len(shards[0]) == 3
    assert loader.batch_sampler.sampler is loader.sampler  # the user's loader is untouched
    assert not isinstance(loader.sampler, DistributedSampler)


def test_uneven_data_is_padded_so_every_rank_gets_the_same_number_of_batches() -> None:
    loader = DataLoader(TensorDataset(torch.arange(7)), batch_size=2)
    lengths = [len(_indices(shard_dataloader(loader, 3, rank))) for rank in range(3)]
    assert lengths == [3, 3, 3]


def test_each_epoch_reshuffles_identically_on_every_rank() -> None:
    fabric = Fabric(accelerator="cpu")
    shards = [
        fabric.setup_dataloaders(shard_dataloader(DataLoader(DATA, batch_size=5, shuffle=True), 2, rank))
        for rank in range(2)
    ]
    epochs = [[_indices(shard) for shard in shards] for _ in range(3)]
    for first, second in epochs:
        assert sorted(first + second) == list(range(10))
    assert epochs[0][0] != epochs[1][0] or epochs[1][0] != epochs[2][0]


class EveryOtherSampler(Sampler[int]):
    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self) -> Iterator[int]:
        return iter(range(0, self.size, 2))

    def __len__(self) -> int:
        return (self.size + 1) // 2


def test_a_custom_sampler_is_wrapped_so_it_still_shards() -> None:
    loader = DataLoader(DATA, batch_size=1, sampler=EveryOtherSampler(10))
    shards = [shard_dataloader(loader, 2, rank) for rank in range(2)]
    assert all(isinstance(shard.sampler, ShardedSampler) for shard in shards)
    first, second = (_indices(shard) for shard in shards)
    assert first == [0, 4, 8] and second == [2, 6, 0]  # padded with the first element


def test_a_custom_batch_sampler_is_sharded_by_batches() -> None:
    batches = BatchSampler(EveryOtherSampler(10), batch_size=2, drop_last=False)

    class MyBatchSampler(Sampler[list[int]]):
        def __iter__(self) -> Iterator[list[int]]:
            return iter(batches)

        def __len__(self) -> int:
            return len(batches)

    loader = DataLoader(DATA, batch_sampler=MyBatchSampler())
    first, second = (_indices(shard_dataloader(loader, 2, rank)) for rank in range(2))
    assert first == [0, 2, 8] and second == [4, 6, 0, 2]


def test_a_users_distributed_sampler_is_left_alone() -> None:
    loader = DataLoader(DATA, sampler=DistributedSampler(DATA, num_replicas=4, rank=1))
    assert shard_dataloader(loader, 2, 0) is loader


def test_an_iterable_dataset_cannot_be_sharded_and_says_so() -> None:
    class Stream(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Iterator[int]:
            return iter(range(3))

    loader = DataLoader(Stream())
    with pytest.warns(UserWarning, match="cannot shard"):
        assert shard_dataloader(loader, 2, 0) is loader


def test_setup_before_launch_is_a_clear_error() -> None:
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    assert fabric.world_size == 2 and fabric.global_rank == 0
    with pytest.raises(RuntimeError, match=r"call `fabric.launch\(\)` before"):
        fabric.setup(torch.nn.Linear(1, 1))
    with pytest.raises(RuntimeError, match=r"call `fabric.launch\(\)` before"):
        fabric.all_reduce(torch.ones(1))


def test_ddp_from_a_notebook_points_to_ddp_notebook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("fabric.fabric.is_interactive", lambda: True)
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    with pytest.raises(RuntimeError, match="strategy='ddp_notebook'"):
        fabric.launch()


def test_backend_follows_the_device_and_can_be_overridden() -> None:
    cpu = DDPStrategy(parallel_devices=[torch.device("cpu")] * 2)
    cuda = DDPStrategy(parallel_devices=[torch.device("cuda", 0), torch.device("cuda", 1)])
    custom = DDPStrategy(parallel_devices=[torch.device("cpu")] * 2, process_group_backend="mpi")
    assert (cpu.process_group_backend, cuda.process_group_backend, custom.process_group_backend) == (
        "gloo",
        "nccl",
        "mpi",
    )


def test_unknown_start_method_lists_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match=r"start_method='thread' is not supported. Accepted values: \['popen'"):
        DDPStrategy(start_method="thread")  # type: ignore[arg-type]


def test_a_users_cluster_environment_plugin_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    class TwoNodeEnvironment(LocalEnvironment):
        def node_rank(self) -> int:
            return 1

    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2, num_nodes=2, plugins=[TwoNodeEnvironment()])
    assert (fabric.node_rank, fabric.global_rank, fabric.world_size) == (1, 2, 4)


def test_torchrun_variables_make_launch_unnecessary(monkeypatch: pytest.MonkeyPatch) -> None:
    variables = {"RANK": "1", "GROUP_RANK": "0", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    strategy = DDPStrategy()
    strategy.connect(
        accelerator=CPUAccelerator(),
        precision=Precision(),
        checkpoint_io=None,
        devices=[torch.device("cpu")] * 2,
        num_nodes=1,
    )
    assert isinstance(strategy.cluster_environment, TorchElasticEnvironment)
    assert not strategy.needs_launch
    assert (strategy.global_rank, strategy.local_rank, strategy.world_size) == (1, 1, 2)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", world_size=1, rank=0)
    yield
    dist.destroy_process_group()


def test_ddp_options_reach_distributed_data_parallel(one_rank_group: None) -> None:
    strategy = DDPStrategy(
        find_unused_parameters=True,
        gradient_as_bucket_view=True,
        bucket_cap_mb=1,
        parallel_devices=[torch.device("cpu")],
        cluster_environment=LocalEnvironment(),
    )
    wrapped = strategy.setup_module(torch.nn.Linear(2, 2))
    assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
    assert wrapped.find_unused_parameters is True
    assert wrapped.gradient_as_bucket_view is True
    assert wrapped.bucket_bytes_cap == 1024 * 1024


def test_default_timeout_is_torchs_and_configurable() -> None:
    assert DDPStrategy().timeout == timedelta(minutes=30)
    assert DDPStrategy(timeout=timedelta(seconds=5)).timeout == timedelta(seconds=5)


def test_fast_shutdown_still_writes_what_an_unclosed_file_in_a_reference_cycle_buffered(tmp_path: Path) -> None:
    import subprocess
    import sys

    target = tmp_path / "log.txt"
    code = f"""
from fabric.utilities.processes.exit import prepare_fast_shutdown
class Holder:
    def __init__(self):
        self.file = open({str(target)!r}, "w")
        self.me = self  # a cycle: only a garbage collection would close and flush the file
holder = Holder()
holder.file.write("buffered line")
prepare_fast_shutdown()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert target.read_text() == "buffered line"


def test_fast_shutdown_touches_no_deprecated_module_proxy_and_no_dead_weak_proxy() -> None:
    import subprocess
    import sys

    code = """
import weakref
import torch.distributed
from fabric.utilities.processes.exit import prepare_fast_shutdown
class Target:
    pass
target = Target()
proxies = [weakref.proxy(target)]  # kept alive in a list the collector sees; its referent dies next
del target
prepare_fast_shutdown()
print("done")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "done\n"
    assert result.stderr == ""  # was: FutureWarning: torch.distributed.reduce_op is deprecated


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_process_group_of_one_rank_is_released_before_the_interpreter_shuts_down(
    strategy: str, tmp_path: Path
) -> None:
    """One rank holds a process group too (so does DeepSpeed on one device): released at exit like a job's, the
    gloo abort at interpreter shutdown (workaround ``gloo-shutdown-abort``) cannot turn a finished run's exit 0
    into SIGABRT."""
    import subprocess
    import sys

    code = f"""
import atexit
import torch
import torch.distributed as dist
from fabric import Fabric
atexit.register(lambda: print("group at exit:", dist.is_initialized()))  # runs after Fabric's cleanup (LIFO)
fabric = Fabric(accelerator="cpu", devices=1, strategy={strategy!r})
fabric.launch()
model = fabric.setup(torch.nn.Linear(2, 2))
print("group while training:", dist.is_initialized(), "world size", fabric.world_size)
"""
    script = tmp_path / "one_rank.py"  # a file: the launcher re-runs scripts, not `python -c`
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["group while training: True world size 1", "group at exit: False"]
