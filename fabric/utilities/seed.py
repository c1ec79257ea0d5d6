"""Seed every random number generator a training run uses, in one call, and (``workers=True``) every
dataloader worker distinctly per rank and worker."""

from __future__ import annotations

import hashlib
import logging
import os
import random

import torch
from lightning_utilities.core.imports import RequirementCache

from fabric.utilities.rank_zero import rank_zero_warn

#: Set by :func:`seed_everything` so processes started later (other ranks) pick up the same seed.
SEED_ENV_VAR = "FABRIC_GLOBAL_SEED"
#: ``"1"`` after ``seed_everything(workers=True)``: ``fabric.setup_dataloaders`` installs :func:`worker_init_function`.
SEED_WORKERS_ENV_VAR = "FABRIC_SEED_WORKERS"
_NUMPY_AVAILABLE = RequirementCache("numpy")
_log = logging.getLogger(__name__)
#: The largest seed every generator takes (NumPy's are 32-bit).
MAX_SEED = 2**32 - 1


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed Python's ``random``, NumPy (if installed) and torch (CPU and every CUDA device).

    Without ``seed``, the seed a parent process recorded in ``FABRIC_GLOBAL_SEED`` is used, else 0.
    With ``workers=True``, dataloaders set up afterwards by ``fabric.setup_dataloaders`` (that have no
    ``worker_init_fn`` of their own) seed each worker process from the seed, the rank and the worker id,
    so no two workers of the job draw the same random numbers and a rerun draws them again. ``verbose``: log
    ``Seed set to N`` at INFO on this module's logger (Lightning's argument and message).
    Returns the seed used.
    """
    if seed is None:
        recorded = os.environ.get(SEED_ENV_VAR)
        if recorded is None:
            rank_zero_warn(f"seed_everything() got no seed and {SEED_ENV_VAR} is unset; using seed 0.")
        seed = int(recorded) if recorded is not None else 0
    check_seed_range(seed)
    os.environ[SEED_ENV_VAR] = str(seed)
    os.environ[SEED_WORKERS_ENV_VAR] = str(int(workers))
    random.seed(seed)
    if _NUMPY_AVAILABLE:
        import numpy

        numpy.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if verbose:
        _log.info("Seed set to %d", seed)
    return seed


def check_seed_range(seed: int) -> int:
    """``seed`` if every generator takes it (``[0, MAX_SEED]``), else ``ValueError`` naming it."""
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed={seed} is out of range; accepted: an int in [0, {MAX_SEED}].")
    return seed


def seeds_workers() -> bool:
    """Whether the last :func:`seed_everything` (here or in the process that started this one) asked for
    worker seeding."""
    return os.environ.get(SEED_WORKERS_ENV_VAR) == "1"


def worker_init_function(worker_id: int, rank: int) -> None:
    """``DataLoader(worker_init_fn=...)`` that seeds ``random``, NumPy and torch in a worker process.

    torch seeds worker ``i`` of each pass with ``base + i``, ``base`` drawn from the main process's
    generator, which ``seed_everything`` made the same on every rank. The worker's seeds mix ``base``,
    ``worker_id`` and ``rank``, so they differ across workers and ranks and repeat in a rerun.
    """
    base = torch.initial_seed() - worker_id
    digest = hashlib.blake2b(f"{base}/{worker_id}/{rank}".encode(), digest_size=20).digest()
    torch.manual_seed(int.from_bytes(digest[:8], "little"))
    random.seed(int.from_bytes(digest[8:16], "little"))
    if _NUMPY_AVAILABLE:
        import numpy

        numpy.random.seed(int.from_bytes(digest[16:], "little"))  # NumPy takes 32-bit seeds


def configure_deterministic_mode() -> None:
    """Deterministic kernels only (Composer's ``configure_deterministic_mode``, the Trainer's
    ``deterministic_mode=True``): ``torch.use_deterministic_algorithms(True)``, cuDNN deterministic without
    benchmarking, and the fixed cuBLAS workspace deterministic results need; warns that it costs speed."""
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    # cuBLAS needs a fixed workspace for deterministic results (https://docs.nvidia.com/cuda/cublas/#results-reproducibility)
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    rank_zero_warn("Deterministic mode is activated. This will negatively impact performance.")
