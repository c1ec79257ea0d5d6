"""The Trainer's core, as Composer's ``composer.core``: events, the engine that runs algorithms and callbacks
on them, the training state, time, and the Algorithm and Callback bases with the passes that order
algorithms. Their public names are exported by :mod:`fabric.trainer` (nothing here, by design)."""

__all__: list[str] = []
