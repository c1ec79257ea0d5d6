"""The ``fabric`` command line (``fabric run model ...``): filled in by the CLI work."""
