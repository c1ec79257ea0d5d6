"""Cluster environments and the one place where the running launcher is detected (:func:`detect_environment`).

``ENVIRONMENT_REGISTRY`` lists the environments in detection priority: the first whose ``detect`` is true
describes this process. ``"local"`` always matches and is therefore only the fallback, tried after every
other entry, including environments users register later.
"""

from __future__ import annotations

from collections.abc import Mapping

from fabric.plugins.environments.cluster_environment import ClusterEnvironment
from fabric.plugins.environments.kubeflow import KubeflowEnvironment
from fabric.plugins.environments.local import LocalEnvironment, find_free_port
from fabric.plugins.environments.lsf import LSFEnvironment
from fabric.plugins.environments.mpi import MPIEnvironment
from fabric.plugins.environments.slurm import SLURMEnvironment, expand_hostlist
from fabric.plugins.environments.torchelastic import TorchElasticEnvironment
from fabric.utilities.registry import Registry

#: Name of the environment used when no other one is detected.
FALLBACK_ENVIRONMENT = "local"

ENVIRONMENT_REGISTRY: Registry[ClusterEnvironment] = Registry("cluster environment")
# Registration order is detection priority. torchrun inside a SLURM or Kubeflow job sets its own, more
# precise variables, so it comes first; Kubeflow defers to torchrun by itself (see its detect()).
ENVIRONMENT_REGISTRY.register("torchelastic", TorchElasticEnvironment, description="processes started by torchrun")
ENVIRONMENT_REGISTRY.register("slurm", SLURMEnvironment, description="tasks started by SLURM's srun")
ENVIRONMENT_REGISTRY.register("kubeflow", KubeflowEnvironment, description="Kubeflow PyTorchJob, one process per pod")
ENVIRONMENT_REGISTRY.register("lsf", LSFEnvironment, description="IBM LSF job launched with jsrun")
ENVIRONMENT_REGISTRY.register("mpi", MPIEnvironment, description="OpenMPI, MPICH or Intel MPI launcher")
ENVIRONMENT_REGISTRY.register(FALLBACK_ENVIRONMENT, LocalEnvironment, description="Fabric starts the processes")


def _environment_class(name: str) -> type[ClusterEnvironment]:
    target = ENVIRONMENT_REGISTRY.get(name).resolve_target()
    if not (isinstance(target, type) and issubclass(target, ClusterEnvironment)):
        raise TypeError(f"Cluster environment {name!r} must be registered as a ClusterEnvironment subclass.")
    return target


def detect_environment(environ: Mapping[str, str] | None = None) -> ClusterEnvironment:
    """The environment describing this process: the first registered one whose ``detect`` is true.

    ``environ`` defaults to :data:`os.environ`; the returned environment keeps reading the same mapping.
    """
    kwargs = {} if environ is None else {"environ": environ}
    for name in ENVIRONMENT_REGISTRY.names():
        if name != FALLBACK_ENVIRONMENT and _environment_class(name).detect(environ):
            return ENVIRONMENT_REGISTRY.create(name, **kwargs)
    return ENVIRONMENT_REGISTRY.create(FALLBACK_ENVIRONMENT, **kwargs)


__all__ = [
    "ENVIRONMENT_REGISTRY",
    "FALLBACK_ENVIRONMENT",
    "ClusterEnvironment",
    "KubeflowEnvironment",
    "LSFEnvironment",
    "LocalEnvironment",
    "MPIEnvironment",
    "SLURMEnvironment",
    "TorchElasticEnvironment",
    "detect_environment",
    "expand_hostlist",
    "find_free_port",
]
