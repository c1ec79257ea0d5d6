"""The Fabric choices, and the environment-variable contract between ``fabric run model`` and ``Fabric()``.

The CLI sets :data:`CLI_MARKER` and one variable per option the user actually passed; ``Fabric()``
reads them only when the marker is present, so a stale ``FABRIC_*`` variable left in a shell never
overrides code. This module must stay free of heavy imports: the CLI imports it before torch.
"""

from __future__ import annotations

#: Set to ``"1"`` in every process the CLI starts.
CLI_MARKER = "FABRIC_CLI_LAUNCHED"

#: The Fabric choices, in ``Fabric(...)``'s argument order: the one list of them. The connector resolves these, the
#: Trainer passes these on to Fabric, and the CLI has an option for each (``tests/utilities/test_cli_contract.py``
#: holds them to it).
FABRIC_CHOICES: tuple[str, ...] = ("accelerator", "strategy", "devices", "num_nodes", "precision")

#: ``Fabric(...)`` argument name -> environment variable the CLI sets for it (``FABRIC_ACCELERATOR``, ...).
CLI_SETTINGS: dict[str, str] = {name: f"FABRIC_{name.upper()}" for name in FABRIC_CHOICES}

#: ``--mesh`` as ``NAME=DEGREE,...`` (:meth:`fabric.strategies.mesh.MeshPlan.parse`): the device mesh the script's FSDP
#: or model-parallel strategy builds. Not a ``Fabric(...)`` argument: a strategy object carries its mesh.
CLI_MESH = "FABRIC_MESH"

#: The run directory (``--run-dir``), absolute, in every process the CLI starts: where ranks may put artifacts.
RUN_DIRECTORY_VARIABLE = "FABRIC_RUN_DIRECTORY"

#: A fault-tolerant run's replica groups (``fabric.strategies.FaultTolerantDDPStrategy``): this group's index, how many
#: groups the run is planned for, and the torchft lighthouse's address (torchft's own variable, so a group started by
#: torchft's tools finds it too).
FT_REPLICA_GROUP = "FABRIC_FT_REPLICA_GROUP"
FT_REPLICA_GROUPS = "FABRIC_FT_REPLICA_GROUPS"
FT_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"
