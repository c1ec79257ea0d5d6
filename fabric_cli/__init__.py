"""The ``fabric`` command line: ``fabric run model ...`` starts a Fabric script on several processes."""
