"""The import name ``fabric`` is shared with Fabric, the SSH library: tell the user when the two collide.

Two ways they collide, both caught here with an error naming the clash instead of a puzzling ``ImportError``
deep inside:

- both were pip-installed into one environment: they share the directory ``site-packages/fabric``, and the one
  installed last wrote its files over the other's. :func:`refuse_mixed_install` (run by ``import fabric``, one
  ``stat`` call) finds the SSH library's modules inside this package's directory;
- the SSH library comes first on ``sys.path``: ``import fabric`` finds it, and this project's command line
  (``fabric run``) cannot start. ``fabric_cli`` checks that on import and says which file was found (this module
  is not there to help then: the other ``fabric`` has no ``fabric.utilities``).
"""

from __future__ import annotations

import os

#: This project's distribution name, also ``fabric.__distribution__`` (which ``fabric_cli`` checks).
DISTRIBUTION = "torch-fabric"
#: Modules of the SSH library's package that this project does not have.
_SSH_LIBRARY_MODULES = ("connection.py", "transfer.py")
_ADVICE = (
    "The SSH library Fabric (pip install fabric) uses the same import name `fabric` as this project "
    f"({DISTRIBUTION}); one environment can hold only one of them. Keep them in separate virtual environments"
)


def refuse_mixed_install(package_directory: str) -> None:
    """Raise ImportError if the SSH library's files were installed into this package's directory."""
    found = [name for name in _SSH_LIBRARY_MODULES if os.path.exists(os.path.join(package_directory, name))]
    if found:
        raise ImportError(
            f"{package_directory} holds files of two packages: this project's and the SSH library Fabric's "
            f"({', '.join(found)}); pip installed one over the other. {_ADVICE}: run `pip uninstall -y fabric "
            f"{DISTRIBUTION}`, then install the one this environment is for."
        )
