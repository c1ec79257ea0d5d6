"""Running programs written for Lightning Fabric or Composer unchanged: opt-in drop-in modes (never on by default).

``python -m fabric.compat.lightning -m litgpt pretrain ...`` runs a program whose ``lightning.fabric`` imports and
``L.Fabric`` are answered by this project; ``python -m fabric.compat.composer train.py`` one whose ``composer``
imports are. Each mode has one table (:mod:`fabric.compat.lightning_names`, :mod:`fabric.compat.composer_names`)
saying for each name what answers it here or why nothing does; :mod:`fabric.compat.aliases` applies a table and
:mod:`fabric.compat.runner` runs the program.
"""

__all__ = ["DROP_IN_MODES"]

#: The drop-in modes, by name, and the module that runs a program in each (``python -m MODULE SCRIPT``,
#: ``fabric run model --drop-in=NAME``).
DROP_IN_MODES = {"composer": "fabric.compat.composer", "lightning": "fabric.compat.lightning"}
