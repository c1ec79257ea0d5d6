"""The arguments every parallel strategy takes (``ParallelArgs``: backend, timeout, stall threshold, plugins) mean
the same in each: given to any of them they reach the same attributes, and a bad value is refused naming it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch

from fabric.accelerators.cpu import CPUAccelerator
from fabric.plugins.environments import LocalEnvironment
from fabric.plugins.precision.precision import Precision
from fabric.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, ParallelStrategy
from fabric.strategies.parallel import ProcessGroupOptions

STRATEGIES: dict[str, Callable[..., ParallelStrategy]] = {
    "ddp": DDPStrategy,
    "fsdp": FSDPStrategy,
    "deepspeed": DeepSpeedStrategy,
    "model_parallel": functools.partial(ModelParallelStrategy, lambda model, mesh: model),
}
each_strategy = pytest.mark.parametrize("make", STRATEGIES.values(), ids=list(STRATEGIES))


@each_strategy
def test_the_common_options_reach_the_same_attributes_in_every_parallel_strategy(
    make: Callable[..., ParallelStrategy],
) -> None:
    accelerator, precision, environment = CPUAccelerator(), Precision(), LocalEnvironment()
    devices = [torch.device("cpu")] * 2
    strategy = make(
        accelerator=accelerator,
        precision=precision,
        cluster_environment=environment,
        parallel_devices=devices,
        process_group_backend="mpi",
        timeout=timedelta(seconds=7),
        stall_threshold=timedelta(minutes=2),
    )
    assert strategy.process_group_options == ProcessGroupOptions("mpi", timedelta(seconds=7), 120.0)
    assert (strategy.process_group_backend, strategy.timeout, strategy.stall_threshold) == (
        "mpi",
        timedelta(seconds=7),
        120.0,
    )
    assert strategy.accelerator is accelerator and strategy.precision is precision
    assert strategy.own_cluster_environment is environment and strategy.parallel_devices == devices


@each_strategy
def test_every_parallel_strategy_has_the_same_defaults(make: Callable[..., ParallelStrategy]) -> None:
    strategy = make(parallel_devices=[torch.device("cpu")] * 2)
    assert (strategy.process_group_backend, strategy.timeout, strategy.stall_threshold) == (
        "gloo",  # NCCL only on CUDA
        timedelta(minutes=30),
        60.0,
    )


@each_strategy
@pytest.mark.parametrize(
    ("argument", "refusal"),
    [
        ({"stall_threshold": -1}, r"stall_threshold=-1 is not valid. Accepted: a timedelta or seconds >= 0 \(0: off\)"),
        ({"stall_threshold": timedelta(seconds=-5)}, r"stall_threshold=datetime.timedelta\(days=-1, seconds=86395\)"),
        ({"stall_threshold": "60"}, r"stall_threshold='60' is not valid"),
        ({"stall_threshold": float("nan")}, r"stall_threshold=nan is not valid"),
        ({"timeout": 60}, r"timeout=60 is not valid. Accepted: a timedelta greater than 0"),
        ({"timeout": timedelta(0)}, r"timeout=datetime.timedelta\(0\) is not valid"),
        ({"process_group_backend": 1}, r"process_group_backend=1 is not valid. Accepted: a torch.distributed backend"),
    ],
)
def test_a_bad_common_option_is_refused_naming_the_value_by_every_parallel_strategy(
    make: Callable[..., ParallelStrategy], argument: dict[str, Any], refusal: str
) -> None:
    with pytest.raises(ValueError, match=refusal):
        make(**argument)


@pytest.mark.parametrize("make", [STRATEGIES["deepspeed"], STRATEGIES["model_parallel"]], ids=["deepspeed", "mp"])
def test_a_misspelt_option_is_a_type_error_naming_it(make: Callable[..., ParallelStrategy]) -> None:
    # ModelParallelStrategy must not pass it on to FSDPStrategy, which would read it as one of Lightning's options
    for misspelt in ("stall_treshold", "sharding_strategy"):
        with pytest.raises(TypeError, match=rf"got unexpected keyword arguments \['{misspelt}'\]"):
            make(**{misspelt: "FULL_SHARD"})
