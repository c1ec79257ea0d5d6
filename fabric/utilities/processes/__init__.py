"""Processes: supervising the ranks a launcher started (supervision), how a rank's process ends (exit), the
variables a rank reads (rank_environment) and child processes that die with their rank (workers).
Torch-free: the CLI uses them. Nothing is exported here by design: each is imported from its module."""

__all__: list[str] = []
