"""Distributed data parallel: a full replica per process, gradients averaged in the backward pass."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any, Literal

from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from fabric.strategies.launchers.launcher import Launcher
from fabric.strategies.launchers.multiprocessing import MultiProcessLauncher
from fabric.strategies.parallel import ParallelStrategy, split_common_arguments

StartMethod = Literal["popen", "spawn", "fork"]
START_METHODS: tuple[StartMethod, ...] = ("popen", "spawn", "fork")


class DDPStrategy(ParallelStrategy):
    """Wraps the module in :class:`~torch.nn.parallel.DistributedDataParallel` and shards the data.

    Args:
        start_method: how ``fabric.launch()`` starts the local processes: ``"popen"`` re-runs the script
            (``strategy="ddp"``), ``"spawn"``/``"fork"`` run a function in new processes
            (``"ddp_spawn"``, ``"ddp_fork"``, ``"ddp_notebook"``).
        find_unused_parameters, static_graph, gradient_as_bucket_view: passed to ``DistributedDataParallel``.
        **kwargs: the common arguments of every parallel strategy
            (:class:`~fabric.strategies.parallel.ParallelArgs`: ``timeout``, ``process_group_backend``, ...);
            any other goes to ``DistributedDataParallel`` (``bucket_cap_mb``, ``broadcast_buffers``, ...).
    """

    def __init__(
        self,
        *,
        start_method: StartMethod = "popen",
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        **kwargs: Any,
    ) -> None:
        if start_method not in START_METHODS:
            raise ValueError(f"start_method={start_method!r} is not supported. Accepted values: {list(START_METHODS)}.")
        common, ddp_kwargs = split_common_arguments(kwargs)
        super().__init__(**common)
        self.start_method = start_method
        self._ddp_kwargs = {
            "find_unused_parameters": find_unused_parameters,
            "static_graph": static_graph,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            **ddp_kwargs,
        }

    @property
    @override
    def launcher(self) -> Launcher | None:
        if self._launcher is None and self.start_method != "popen":
            self._launcher = MultiProcessLauncher(self.num_processes, self.cluster_environment, self.start_method)
        return super().launcher  # "popen": the script is re-run

    @property
    @override
    def launch_needs_function(self) -> bool:
        return self.start_method != "popen"

    @property
    @override
    def replicates_gradients(self) -> bool:
        return True

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=device_ids, **self._ddp_kwargs)

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager[Any]:
        """Skip the gradient all-reduce (DDP's ``no_sync``) during gradient-accumulation steps."""
        if enabled and isinstance(module, DistributedDataParallel):
            return module.no_sync()
        return contextlib.nullcontext()

    def __repr__(self) -> str:
        return f"DDPStrategy(start_method={self.start_method!r}, devices={len(self._parallel_devices or [])})"
