"""Running programs written for Lightning Fabric unchanged, an opt-in drop-in mode (never on by default).

``python -m fabric.compat.lightning -m litgpt pretrain ...`` (or ``python -m fabric.compat.lightning train.py``)
runs a program whose ``lightning.fabric`` imports and ``L.Fabric`` are answered by this project. One table,
:mod:`fabric.compat.lightning_names`, says for each Lightning Fabric name what answers it here or why nothing does;
:mod:`fabric.compat.aliases` is the mechanism that applies such a table.
"""

#: The drop-in modes, by name, and the module that runs a program in each (``python -m MODULE SCRIPT``,
#: ``fabric run model --drop-in=NAME``).
DROP_IN_MODES = {"lightning": "fabric.compat.lightning"}
