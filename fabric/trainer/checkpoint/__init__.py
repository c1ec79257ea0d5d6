"""Saving and resuming the Trainer mid-run: what a checkpoint holds and how training picks up from it.

Nothing is exported here by design: the Trainer's ``save_*``/``load_*`` arguments build these parts; each is
imported from its module (``fabric.trainer.checkpoint.saver.CheckpointSaver``)."""

__all__: list[str] = []
