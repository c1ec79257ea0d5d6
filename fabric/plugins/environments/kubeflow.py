"""Pods of a Kubeflow ``PyTorchJob``, one process per pod."""

from __future__ import annotations

from collections.abc import Mapping

from typing_extensions import override

from fabric.plugins.environments.torchelastic import TorchElasticEnvironment

_DETECT_VARIABLES = ("KUBERNETES_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
#: Variables that mean torchrun runs inside the pod; then it is a torchelastic job, not this one.
_TORCHELASTIC_VARIABLES = ("GROUP_RANK", "LOCAL_RANK")


class KubeflowEnvironment(TorchElasticEnvironment):
    """The Kubeflow training operator started one process per pod and set the rendezvous variables.

    The variables are torchrun's (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``), but each pod
    counts as one node holding one process, so the local rank is 0 and the node rank is the global rank.
    """

    @classmethod
    @override
    def detect(cls, environ: Mapping[str, str] | None = None) -> bool:
        """Kubernetes and PyTorchJob variables are set, and torchrun's (``GROUP_RANK``, ``LOCAL_RANK``) are not."""
        environ = cls._resolve_environ(environ)
        return all(name in environ for name in _DETECT_VARIABLES) and not any(
            name in environ for name in _TORCHELASTIC_VARIABLES
        )

    launcher_name = "Kubeflow's PyTorchJob"

    @override
    def local_rank(self) -> int:
        return 0

    @override
    def local_world_size(self) -> int | None:
        return 1

    @override
    def node_rank(self) -> int:
        return self.global_rank()
