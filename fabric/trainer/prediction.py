"""Prediction: run the model over a dataloader without gradients, returning or streaming the outputs.

Events: PREDICT_START; per batch PREDICT_BATCH_START, PREDICT_BEFORE_FORWARD, PREDICT_AFTER_FORWARD,
PREDICT_BATCH_END (a callback there sees ``state.outputs``: the way to stream results to disk);
PREDICT_END.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from fabric.trainer.checkpoint.rng import capture_rng_state, restore_rng_state
from fabric.trainer.core.engine import Engine
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State, require_fabric
from fabric.trainer.core.time import Timestamp
from fabric.trainer.data_spec import DataSpec
from fabric.utilities.apply_func import move_data_to_device


def run_prediction(
    state: State,
    engine: Engine,
    dataloader: Iterable[Any],
    spec: DataSpec,
    *,
    return_outputs: bool,
    subset_num_batches: int,
) -> list[Any]:
    """Outputs of every batch (transformed and counted as ``spec`` says), moved to the CPU (or ``[]``)."""
    run_event, model = engine.run_event, state.model
    was_training = model.training
    outputs: list[Any] = []
    state.predict_timestamp = Timestamp()
    training_rng = capture_rng_state()  # like evaluation, predicting leaves training's random draws alone
    model.eval()
    try:
        with torch.no_grad():
            run_event(Event.PREDICT_START)
            for index, batch in enumerate(dataloader):
                if index == subset_num_batches:
                    break
                state.batch = spec.prepare(batch, require_fabric(state).to_device) if spec.transforms else batch
                run_event(Event.PREDICT_BATCH_START)
                run_event(Event.PREDICT_BEFORE_FORWARD)
                state.outputs = model(state.batch)
                run_event(Event.PREDICT_AFTER_FORWARD)
                if return_outputs:
                    outputs.append(move_data_to_device(state.outputs, torch.device("cpu")))
                state.predict_timestamp = state.predict_timestamp.to_next_batch(
                    spec.get_num_samples_in_batch(state.batch) * require_fabric(state).strategy.batch_shares
                )
                run_event(Event.PREDICT_BATCH_END)
            run_event(Event.PREDICT_END)
    finally:
        model.train(was_training)
        restore_rng_state(training_rng)
    return outputs
