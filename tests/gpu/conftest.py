"""Fixtures of the real-GPU tests (every test here carries the ``cuda`` marker; ``tests/conftest.py`` skips them
where there is no CUDA GPU): float32 matmuls stay exact, and each test leaves the GPU's memory as it found it."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _exact_float32_and_free_memory() -> Iterator[None]:
    """No TF32 for float32 matmuls (the references compare float32 results closely); afterwards, free what the
    test allocated on the GPU, so the next test (the out-of-memory one above all) starts from an empty cache."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(precision)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
