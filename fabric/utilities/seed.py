"""Seed every random number generator a training run uses, in one call."""

from __future__ import annotations

import os
import random

import torch
from lightning_utilities.core.imports import RequirementCache

from fabric.utilities.rank_zero import rank_zero_warn

#: Set by :func:`seed_everything` so processes started later (other ranks) pick up the same seed.
SEED_ENV_VAR = "FABRIC_GLOBAL_SEED"
_NUMPY_AVAILABLE = RequirementCache("numpy")
_MAX_SEED = 2**32 - 1


def seed_everything(seed: int | None = None) -> int:
    """Seed Python's ``random``, NumPy (if installed) and torch (CPU and every CUDA device).

    Without ``seed``, the seed a parent process recorded in ``FABRIC_GLOBAL_SEED`` is used, else 0.
    Returns the seed used.
    """
    if seed is None:
        recorded = os.environ.get(SEED_ENV_VAR)
        if recorded is None:
            rank_zero_warn(f"seed_everything() got no seed and {SEED_ENV_VAR} is unset; using seed 0.")
        seed = int(recorded) if recorded is not None else 0
    if not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"seed={seed} is out of range; accepted: an int in [0, {_MAX_SEED}].")
    os.environ[SEED_ENV_VAR] = str(seed)
    random.seed(seed)
    if _NUMPY_AVAILABLE:
        import numpy

        numpy.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    return seed
