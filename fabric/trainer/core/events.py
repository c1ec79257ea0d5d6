"""The Trainer's events: named points around every line of the training, evaluation and predict loops.

Algorithms and callbacks hook these. Where each fires (``fit`` over E epochs of B batches, each split
into M microbatches)::

    INIT                                    once, in Trainer construction, before Fabric sets the
                                            model up (so model surgery changes the plain module)
    BEFORE_LOAD, AFTER_LOAD                 once each at the end of construction, around loading a
                                            checkpoint if there is one (and around load_checkpoint())
    FIT_START                               once per ``fit()`` call
     ITERATION_START                        once per ``fit()`` call (one iteration: no iteration length)
      EPOCH_START                           per epoch (not again when fit() continues an epoch)
        BEFORE_DATALOADER, AFTER_DATALOADER per batch, around fetching it
        BATCH_START                         per batch
        BEFORE_TRAIN_BATCH                  per batch
          BEFORE_FORWARD .. AFTER_BACKWARD  per microbatch (M times per batch):
            BEFORE_FORWARD, AFTER_FORWARD, BEFORE_LOSS, AFTER_LOSS, BEFORE_BACKWARD, AFTER_BACKWARD
        AFTER_TRAIN_BATCH                   per batch, once gradients are complete (synced, unscaled),
                                            before the optimizer step (where clipping belongs)
        BATCH_END                           per batch, after the step and the timestamp advanced
        (evaluation, if eval_interval says so)
        BATCH_CHECKPOINT                    per batch, after BATCH_END and any evaluation
      EPOCH_END, (evaluation), EPOCH_CHECKPOINT   per epoch
      (with an optimizer that steps with a closure, e.g. LBFGS, BEFORE_TRAIN_BATCH .. AFTER_TRAIN_BATCH
      fire once per closure call, inside the step: see :mod:`fabric.trainer.train_step`)
     ITERATION_END, ITERATION_CHECKPOINT    once per ``fit()`` that ends (not on preemption or errors)
    FIT_END                                 once per ``fit()`` call

    EVAL_BEFORE_ALL                         once per evaluation round
      EVAL_START                            per evaluation dataloader
        EVAL_BATCH_START, EVAL_BEFORE_FORWARD, EVAL_AFTER_FORWARD, EVAL_BATCH_END   per batch
      EVAL_END                              per evaluation dataloader
    EVAL_AFTER_ALL                          once per evaluation round
    ``Trainer.eval()`` fires EVAL_STANDALONE_START and EVAL_STANDALONE_END in place of EVAL_BEFORE_ALL
    and EVAL_AFTER_ALL.

    PREDICT_START; PREDICT_BATCH_START, PREDICT_BEFORE_FORWARD, PREDICT_AFTER_FORWARD,
    PREDICT_BATCH_END per batch; PREDICT_END

A callback method for an event has the event's value as its name: ``batch_end(self, state, logger)``.
``Trainer.close()`` then calls every callback's ``close(state, logger)`` and, after all of those,
``post_close()``.
"""

from __future__ import annotations

from enum import Enum


class Event(str, Enum):
    """An event; as in Composer it equals its value and its name in any case (``Event.BATCH_END == "batch_end"
    == "BATCH_END"``), and prints as its value."""

    def __str__(self) -> str:
        return self.value

    def __eq__(self, other: object) -> bool:
        if other.__class__ is Event:  # the hot path: the engine compares events with events
            return self is other
        if isinstance(other, str):
            return self.value == other.lower()
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    # Identity, as equality between events is: a C-level hash, where Enum's hashes the name in Python on every
    # dict lookup (the engine looks up 13 events per batch).
    __hash__ = object.__hash__

    INIT = "init"
    BEFORE_LOAD = "before_load"
    AFTER_LOAD = "after_load"
    FIT_START = "fit_start"
    ITERATION_START = "iteration_start"
    EPOCH_START = "epoch_start"
    BEFORE_DATALOADER = "before_dataloader"
    AFTER_DATALOADER = "after_dataloader"
    BATCH_START = "batch_start"
    BEFORE_TRAIN_BATCH = "before_train_batch"
    BEFORE_FORWARD = "before_forward"
    AFTER_FORWARD = "after_forward"
    BEFORE_LOSS = "before_loss"
    AFTER_LOSS = "after_loss"
    BEFORE_BACKWARD = "before_backward"
    AFTER_BACKWARD = "after_backward"
    AFTER_TRAIN_BATCH = "after_train_batch"
    BATCH_END = "batch_end"
    BATCH_CHECKPOINT = "batch_checkpoint"
    EPOCH_END = "epoch_end"
    EPOCH_CHECKPOINT = "epoch_checkpoint"
    ITERATION_END = "iteration_end"
    ITERATION_CHECKPOINT = "iteration_checkpoint"
    FIT_END = "fit_end"

    EVAL_BEFORE_ALL = "eval_before_all"
    EVAL_START = "eval_start"
    EVAL_BATCH_START = "eval_batch_start"
    EVAL_BEFORE_FORWARD = "eval_before_forward"
    EVAL_AFTER_FORWARD = "eval_after_forward"
    EVAL_BATCH_END = "eval_batch_end"
    EVAL_END = "eval_end"
    EVAL_AFTER_ALL = "eval_after_all"
    EVAL_STANDALONE_START = "eval_standalone_start"
    EVAL_STANDALONE_END = "eval_standalone_end"

    PREDICT_START = "predict_start"
    PREDICT_BATCH_START = "predict_batch_start"
    PREDICT_BEFORE_FORWARD = "predict_before_forward"
    PREDICT_AFTER_FORWARD = "predict_after_forward"
    PREDICT_BATCH_END = "predict_batch_end"
    PREDICT_END = "predict_end"

    @property
    def is_after(self) -> bool:
        """The closing half of a pair (``AFTER_*``, ``*_END``). Algorithms run in reverse order here, so
        one that changed something at the opening half undoes it after those applied later have."""
        return self in _CLOSING_EVENTS

    @property
    def is_eval(self) -> bool:
        return self.value.startswith("eval_")

    @property
    def is_predict(self) -> bool:
        return self.value.startswith("predict_")


_CLOSING_EVENTS = frozenset(
    event
    for event in Event
    if event.value.startswith("after_") or event.value.endswith("_end") or "_after_" in event.value
)
