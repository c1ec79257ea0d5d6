"""Plugins: precision, checkpoint I/O and cluster environments."""
