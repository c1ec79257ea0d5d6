"""Everything on one device in this one process."""

from __future__ import annotations

import torch
from typing_extensions import override

from fabric.accelerators.accelerator import Accelerator
from fabric.plugins.environments.cluster_environment import ClusterEnvironment
from fabric.plugins.io.checkpoint_io import CheckpointIO
from fabric.plugins.precision.precision import Precision
from fabric.strategies.strategy import Strategy


class SingleDeviceStrategy(Strategy):
    def __init__(
        self,
        device: str | torch.device | None = None,
        *,
        accelerator: Accelerator | None = None,
        precision: Precision | None = None,
        checkpoint_io: CheckpointIO | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, precision=precision, checkpoint_io=checkpoint_io)
        self._device = torch.device(device) if device is not None else None

    @override
    def _configure_processes(
        self, devices: list[torch.device], num_nodes: int, cluster_environment: ClusterEnvironment | None
    ) -> None:
        if len(devices) * num_nodes != 1:
            raise ValueError(
                f"strategy='single_device' runs one process, but devices={len(devices)} and num_nodes={num_nodes} "
                "ask for more. Use a distributed strategy such as 'ddp', or devices=1."
            )
        if self._device is None:
            self._device = devices[0]

    @property
    @override
    def root_device(self) -> torch.device:
        if self._device is None:
            raise RuntimeError("SingleDeviceStrategy has no device yet; it must be set up through Fabric.")
        return self._device

    @property
    @override
    def replicates_gradients(self) -> bool:
        return True  # the one process holds every gradient
