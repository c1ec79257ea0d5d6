"""Distributed data parallel: a full replica per process, gradients averaged in the backward pass."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fabric.accelerators.accelerator import Accelerator
from fabric.plugins.environments import ClusterEnvironment
from fabric.plugins.io.checkpoint_io import CheckpointIO
from fabric.plugins.precision.precision import Precision
from fabric.strategies.launchers.launcher import Launcher
from fabric.strategies.launchers.multiprocessing import MultiProcessLauncher
from fabric.strategies.launchers.subprocess_script import SubprocessScriptLauncher
from fabric.strategies.parallel import DEFAULT_STALL_THRESHOLD, DEFAULT_TIMEOUT, ParallelStrategy

StartMethod = Literal["popen", "spawn", "fork"]
START_METHODS: tuple[StartMethod, ...] = ("popen", "spawn", "fork")


class DDPStrategy(ParallelStrategy):
    """Wraps the module in :class:`~torch.nn.parallel.DistributedDataParallel` and shards the data.

    Args:
        start_method: how ``fabric.launch()`` starts the local processes: ``"popen"`` re-runs the script
            (``strategy="ddp"``), ``"spawn"``/``"fork"`` run a function in new processes
            (``"ddp_spawn"``, ``"ddp_fork"``, ``"ddp_notebook"``).
        find_unused_parameters, static_graph, gradient_as_bucket_view, **ddp_kwargs: passed to
            ``DistributedDataParallel``.
    """

    def __init__(
        self,
        *,
        start_method: StartMethod = "popen",
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        accelerator: Accelerator | None = None,
        precision: Precision | None = None,
        checkpoint_io: CheckpointIO | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        parallel_devices: list[torch.device] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        stall_threshold: timedelta | float = DEFAULT_STALL_THRESHOLD,
        **ddp_kwargs: Any,
    ) -> None:
        if start_method not in START_METHODS:
            raise ValueError(f"start_method={start_method!r} is not supported. Accepted values: {list(START_METHODS)}.")
        super().__init__(
            accelerator=accelerator,
            precision=precision,
            checkpoint_io=checkpoint_io,
            cluster_environment=cluster_environment,
            parallel_devices=parallel_devices,
            process_group_backend=process_group_backend,
            timeout=timeout,
            stall_threshold=stall_threshold,
        )
        self.start_method = start_method
        self._ddp_kwargs = {
            "find_unused_parameters": find_unused_parameters,
            "static_graph": static_graph,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            **ddp_kwargs,
        }

    @property
    def launcher(self) -> Launcher | None:
        if self._launcher is None:
            self._launcher = (
                SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
                if self.start_method == "popen"
                else MultiProcessLauncher(self.num_processes, self.cluster_environment, self.start_method)
            )
        return self._launcher

    @property
    def launch_needs_function(self) -> bool:
        return self.start_method != "popen"

    @property
    def replicates_gradients(self) -> bool:
        return True

    def setup_module(self, module: nn.Module) -> nn.Module:
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=device_ids, **self._ddp_kwargs)

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager[Any]:
        """Skip the gradient all-reduce (DDP's ``no_sync``) during gradient-accumulation steps."""
        if enabled and isinstance(module, DistributedDataParallel):
            return module.no_sync()
        return contextlib.nullcontext()

    def __repr__(self) -> str:
        return f"DDPStrategy(start_method={self.start_method!r}, devices={len(self._parallel_devices or [])})"
