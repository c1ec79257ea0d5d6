"""Random number generator states as tensors, so a resumed run draws the same numbers (dropout, augmentation).

Python's ``random``, NumPy's global generator (when NumPy is installed), torch's CPU generator and
every CUDA device's generator are captured as integer tensors: safe for ``torch.load(weights_only=True)``
and of a fixed shape per kind, so every rank's states can be all-gathered into one checkpoint.
"""

from __future__ import annotations

import dataclasses
import random
from types import ModuleType
from typing import Any

import torch
from lightning_utilities.core.imports import RequirementCache

_NUMPY_AVAILABLE = RequirementCache("numpy")


def capture_rng_state() -> dict[str, torch.Tensor]:
    """This process's generator states, as tensors."""
    return RngSnapshot.take().as_tensors()


@dataclasses.dataclass(frozen=True)
class RngSnapshot:
    """This process's generator states as the generators hand them out (immutable tuples and fresh copies).

    Taking one is about a third cheaper than :func:`capture_rng_state`: the Trainer takes one at every epoch start
    and builds the tensors (:meth:`as_tensors`) only when a checkpoint needs them.
    """

    python_state: tuple[Any, ...] | None
    torch_state: torch.Tensor
    numpy_state: tuple[Any, ...] | None
    cuda_states: list[torch.Tensor] | None

    @classmethod
    def take(cls, torch_only: bool = False) -> RngSnapshot:
        """With ``torch_only``, torch's generators alone: Python's and NumPy's cost 40 us a snapshot (NumPy's copies its
        624 words in Python), which a snapshot nothing but torch draws from after need not pay."""
        numpy = None if torch_only else _numpy()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        return cls(
            python_state=None if torch_only else random.getstate(),
            torch_state=torch.get_rng_state(),
            numpy_state=None if numpy is None else numpy.random.get_state(legacy=True),
            cuda_states=torch.cuda.get_rng_state_all() if cuda else None,
        )

    def as_tensors(self) -> dict[str, torch.Tensor]:
        """The states as tensors (what :func:`restore_rng_state` and checkpoints take)."""
        # The arrays go through NumPy where it is installed: several times faster than torch.tensor() over 626
        # Python ints (measured ~200 -> ~50 us per capture).
        numpy = _numpy()
        state = {"torch": self.torch_state}
        if self.python_state is not None:
            version, python_state, gauss = self.python_state
            state["python"] = _int64_tensor((version, *python_state), numpy)
            state["python_gauss"] = torch.tensor([float("nan") if gauss is None else gauss], dtype=torch.float64)
        if numpy is not None and self.numpy_state is not None:
            _, keys, position, has_gauss, cached_gaussian = self.numpy_state
            numpy_state = numpy.empty(len(keys) + 2, dtype=numpy.int64)
            numpy_state[:-2], numpy_state[-2], numpy_state[-1] = keys, position, has_gauss
            state["numpy"] = torch.from_numpy(numpy_state)
            state["numpy_gauss"] = torch.tensor([cached_gaussian], dtype=torch.float64)
        if self.cuda_states is not None:
            state["cuda"] = torch.stack(self.cuda_states)
        return state


def _numpy() -> ModuleType | None:
    """The numpy module, or None where it is not installed."""
    if not _NUMPY_AVAILABLE:
        return None
    import numpy

    return numpy


def _int64_tensor(values: tuple[int, ...], numpy: ModuleType | None) -> torch.Tensor:
    if numpy is None:
        return torch.tensor(values, dtype=torch.int64)
    return torch.from_numpy(numpy.array(values, dtype=numpy.int64))


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng_state` returned (kinds missing on either side are left alone)."""
    if "python" in state:
        python_state = [int(value) for value in state["python"].tolist()]
        gauss = float(state["python_gauss"][0])
        random.setstate((python_state[0], tuple(python_state[1:]), None if gauss != gauss else gauss))
    torch.set_rng_state(state["torch"])
    if _NUMPY_AVAILABLE and "numpy" in state:
        import numpy

        values = state["numpy"].tolist()
        keys = numpy.array(values[:624], dtype=numpy.uint32)
        cached = float(state["numpy_gauss"][0])
        numpy.random.set_state(("MT19937", keys, int(values[624]), int(values[625]), cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))
