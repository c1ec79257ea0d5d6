"""Plugins: precision, checkpoint I/O and cluster environments.

Nothing is exported here by design: each kind is imported from its package (:mod:`fabric.plugins.precision`,
:mod:`fabric.plugins.io`, :mod:`fabric.plugins.environments`)."""

__all__: list[str] = []
