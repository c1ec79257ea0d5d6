"""Pods of a Kubeflow ``PyTorchJob``, one process per pod."""

from __future__ import annotations

from collections.abc import Mapping

from fabric.plugins.environments.cluster_environment import ClusterEnvironment

_DETECT_VARIABLES = ("KUBERNETES_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
#: Variables that mean torchrun runs inside the pod; then it is a torchelastic job, not this one.
_TORCHELASTIC_VARIABLES = ("GROUP_RANK", "LOCAL_RANK")


class KubeflowEnvironment(ClusterEnvironment):
    """The Kubeflow training operator started one process per pod and set the rendezvous variables.

    Each pod counts as one node holding one process, so the local rank is 0 and the node rank is the
    global rank.
    """

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return self._require("MASTER_ADDR")

    @property
    def main_port(self) -> int:
        return self._int("MASTER_PORT")

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> bool:
        """Kubernetes and PyTorchJob variables are set, and torchrun's (``GROUP_RANK``, ``LOCAL_RANK``) are not."""
        environ = cls._resolve_environ(environ)
        return all(name in environ for name in _DETECT_VARIABLES) and not any(
            name in environ for name in _TORCHELASTIC_VARIABLES
        )

    def world_size(self) -> int:
        return self._int("WORLD_SIZE")

    def global_rank(self) -> int:
        return self._int("RANK")

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return self.global_rank()
