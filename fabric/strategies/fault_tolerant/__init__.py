"""Fault tolerance without restarts, on torchft (the optional ``[ft]`` extra): replica groups that die, rejoin and
recover their state from a peer while the others train on."""
