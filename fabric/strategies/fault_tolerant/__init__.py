"""Fault tolerance without restarts, on torchft (the optional ``[ft]`` extra): replica groups that die, rejoin and
recover their state from a peer while the others train on.

Nothing is exported here by design: the strategies are :mod:`fabric.strategies`' names (loaded on first use, as
torchft is)."""

__all__: list[str] = []
