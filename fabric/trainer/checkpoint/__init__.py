"""Saving and resuming the Trainer mid-run: what a checkpoint holds and how training picks up from it."""
