"""A stand-in for a malicious checkpoint entry: unpickled the unsafe way, it creates a marker file.

Tests put it into checkpoints and assert that loading refuses it and that the marker never appears.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class MarkerPayload:
    """Unpickles into ``Path(marker).touch()``: what a malicious checkpoint would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return Path.touch, (self.marker,)
