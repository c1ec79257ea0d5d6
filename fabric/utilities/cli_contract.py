"""The environment-variable contract between ``fabric run model`` and ``Fabric()``.

The CLI sets :data:`CLI_MARKER` and one variable per option the user actually passed; ``Fabric()``
reads them only when the marker is present, so a stale ``FABRIC_*`` variable left in a shell never
overrides code. This module must stay free of heavy imports: the CLI imports it before torch.
"""

from __future__ import annotations

#: Set to ``"1"`` in every process the CLI starts.
CLI_MARKER = "FABRIC_CLI_LAUNCHED"

#: ``Fabric(...)`` argument name -> environment variable the CLI sets for it.
CLI_SETTINGS: dict[str, str] = {
    "accelerator": "FABRIC_ACCELERATOR",
    "strategy": "FABRIC_STRATEGY",
    "devices": "FABRIC_DEVICES",
    "num_nodes": "FABRIC_NUM_NODES",
    "precision": "FABRIC_PRECISION",
}

#: The run directory (``--run-dir``), absolute, in every process the CLI starts: where ranks may put artifacts.
RUN_DIRECTORY_VARIABLE = "FABRIC_RUN_DIRECTORY"
