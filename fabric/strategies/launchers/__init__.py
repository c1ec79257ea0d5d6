"""Launchers: how a strategy starts its processes."""
