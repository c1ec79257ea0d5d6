"""The ``fabric`` command line: ``fabric run model ...`` starts a Fabric script on several processes."""

import fabric

__all__ = ["EXPECTED_DISTRIBUTION"]

#: ``fabric.__distribution__`` of this project's package (``fabric.utilities.name_clash.DISTRIBUTION``); spelt
#: out here because another package found as ``fabric`` has no ``fabric.utilities`` to import it from.
EXPECTED_DISTRIBUTION = "torch-fabric"

if getattr(fabric, "__distribution__", None) != EXPECTED_DISTRIBUTION:
    raise ImportError(
        f"`import fabric` found {getattr(fabric, '__file__', None) or 'a namespace package'}, which is not this "
        f"project's package ({EXPECTED_DISTRIBUTION}). The SSH library Fabric (pip install fabric) uses the same "
        "import name `fabric`; keep the two in separate virtual environments, or put this project first on sys.path."
    )
