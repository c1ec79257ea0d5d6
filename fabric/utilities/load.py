"""Reading a ``torch.save`` file lazily: its tensors memory-mapped, read from disk when first used.

A program that loads a large checkpoint into a model it has just built (litgpt reads ``lit_model.pth`` so) never
holds a second copy of the weights in memory. This is what Lightning's private ``_lazy_load`` is used for;
``fabric.load`` itself reads a file whole, so the result stays valid if the file is overwritten afterwards.
"""

from __future__ import annotations

import os
import zipfile
from typing import Any

import torch


def lazy_load(path: str | os.PathLike[str], weights_only: bool = True) -> Any:
    """What ``torch.save`` wrote to the local file ``path``, its tensors memory-mapped (read on first use).

    Files in torch's legacy (pre-zip) format cannot be mapped and are read whole. Overwriting the file in place
    (not by an atomic rename, as ``fabric.save`` does) while its tensors are in use makes reading them fail.
    """
    mapped = zipfile.is_zipfile(path)
    return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mapped)


class NotYetLoadedTensor:
    """Lightning's ``_NotYetLoadedTensor`` (a tensor of a lazily loaded file, read on use): nothing here is one,
    since :func:`lazy_load` gives real, memory-mapped tensors, so ``isinstance`` checks for it are False."""

    def __init__(self) -> None:
        raise TypeError("NotYetLoadedTensor is never made: lazy_load returns memory-mapped torch tensors.")
