"""Launchers: how a strategy starts its processes.

Nothing is exported here by design: a strategy picks its launcher; each is imported from its module."""

__all__: list[str] = []
