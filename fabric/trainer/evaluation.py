"""Evaluation: ``Evaluator`` (a labelled eval dataloader) and the loop that runs evaluators with their events.

The random number generators are put back after a round, so evaluating (or not) never changes
training. Per round: EVAL_BEFORE_ALL; per evaluator: EVAL_START, per batch EVAL_BATCH_START,
EVAL_BEFORE_FORWARD, EVAL_AFTER_FORWARD, EVAL_BATCH_END; the metrics are computed (synced across
ranks), stored in ``state.metrics["metrics/<label>/<name>"]`` and logged; EVAL_END. Then
EVAL_AFTER_ALL (``Trainer.eval()`` fires EVAL_STANDALONE_START/END in their place). The model runs in
eval mode without gradients and returns to train mode afterwards.

``Evaluator(device_eval_microbatch_size=m)`` runs each batch as forwards of at most ``m`` samples (Composer's
option, for eval batches that do not fit at once): EVAL_BEFORE_FORWARD/EVAL_AFTER_FORWARD fire per
microbatch with ``state.batch`` the microbatch, the metrics see every microbatch, and at EVAL_BATCH_END
``state.batch`` is the whole batch again and ``state.outputs`` the microbatches' outputs joined (concatenated
tensors, else a list). ``"auto"`` starts at the whole batch and halves on out-of-memory errors, agreed over
the ranks. No forward that gave outputs runs twice: after an out-of-memory error (on any rank) each rank runs
only what it has left, smaller, so EVAL_AFTER_FORWARD fires once per sample; only the forward that ran out of
memory had its EVAL_BEFORE_FORWARD without an EVAL_AFTER_FORWARD. The metrics are updated once the whole batch
went through.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fabric.trainer.checkpoint.rng import capture_rng_state, restore_rng_state
from fabric.trainer.core.engine import Engine
from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State, loader_length, require_fabric
from fabric.trainer.core.time import Timestamp
from fabric.trainer.data_spec import DataSpec, ensure_data_spec
from fabric.trainer.intervals import IntervalInput
from fabric.trainer.metrics import compute_metrics, update_metric
from fabric.trainer.microbatch import is_out_of_memory, joined_outputs


@dataclass
class Evaluator:
    """An eval dataloader with a label (metric names become ``metrics/<label>/<name>``).

    ``dataloader`` may be a :class:`~fabric.trainer.data_spec.DataSpec`; it is one after construction, as in
    Composer (``evaluator.dataloader.num_samples``, ``.dataloader.dataloader``), also kept as ``data_spec``;
    ``loader`` is what a round iterates (the spec's loader as the Trainer set it up). ``metric_names`` picks some
    of the model's eval metrics (default: all); ``eval_interval`` overrides the Trainer's; ``subset_num_batches`` limits
    the batches per round (-1: all; ``None``, the default: the Trainer's ``eval_subset_num_batches``, which the
    Trainer writes here, as Composer does); ``device_eval_microbatch_size`` splits each batch into forwards of
    at most that many samples (``"auto"``: halve on out-of-memory; ``None``: the whole batch at once).
    """

    label: str
    dataloader: Iterable[Any] | DataSpec
    metric_names: Sequence[str] | None = None
    eval_interval: IntervalInput | None = None
    subset_num_batches: int | None = None
    device_eval_microbatch_size: int | str | None = None
    data_spec: DataSpec = field(init=False)
    loader: Iterable[Any] = field(init=False, repr=False)
    #: With ``device_eval_microbatch_size="auto"``: the size that fitted last, where the next batch starts.
    auto_microbatch_size: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.dataloader = self.data_spec = ensure_data_spec(self.dataloader)
        self.loader = self.data_spec.dataloader
        if not self.label or not isinstance(self.label, str):
            raise ValueError(f"An Evaluator needs a non-empty string label, got {self.label!r}.")
        subset = self.subset_num_batches
        if subset is not None and (type(subset) is not int or subset == 0 or subset < -1):
            raise ValueError(
                f"Evaluator {self.label!r}: subset_num_batches={subset!r} must be -1 (all), a positive int or None "
                "(the Trainer's eval_subset_num_batches)."
            )
        size = self.device_eval_microbatch_size
        if not (size is None or size == "auto" or (type(size) is int and size >= 1)):
            raise ValueError(
                f"Evaluator {self.label!r}: device_eval_microbatch_size={size!r} must be a positive int, 'auto' or "
                "None."
            )


def ensure_evaluators(eval_dataloader: Any) -> list[Evaluator]:
    """Accept a dataloader, an Evaluator, a dict ``{label: dataloader}`` or a list of those; labels must be unique."""
    if eval_dataloader is None:
        return []
    if isinstance(eval_dataloader, Mapping):
        evaluators = [Evaluator(label, loader) for label, loader in eval_dataloader.items()]
    elif isinstance(eval_dataloader, (list, tuple)):
        evaluators = [item if isinstance(item, Evaluator) else Evaluator("eval", item) for item in eval_dataloader]
    elif isinstance(eval_dataloader, Evaluator):
        evaluators = [eval_dataloader]
    else:
        evaluators = [Evaluator("eval", eval_dataloader)]
    labels = [evaluator.label for evaluator in evaluators]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise ValueError(f"Evaluator labels must be unique; {duplicates} appear more than once in {labels}.")
    return evaluators


def select_metrics(metrics: Mapping[str, Any], evaluator: Evaluator) -> dict[str, Any]:
    """The evaluator's share of the model's eval metrics; unknown names fail with the known ones listed."""
    if evaluator.metric_names is None:
        return dict(metrics)
    unknown = [name for name in evaluator.metric_names if name not in metrics]
    if unknown:
        raise ValueError(
            f"Evaluator {evaluator.label!r} asks for metrics {unknown}, which the model does not have; "
            f"it has {sorted(metrics)}."
        )
    return {name: metrics[name] for name in evaluator.metric_names}


class EvaluationInterrupted(Exception):
    """``stop_requested`` said yes between two evaluation batches (a preemption): the round was abandoned, and
    none of its metrics were recorded."""


def run_evaluators(
    state: State,
    engine: Engine,
    logger: Logger,
    evaluators: Sequence[Evaluator],
    *,
    standalone: bool = False,
    stop_requested: Callable[[], bool] | None = None,
    subset_num_batches: int = -1,
) -> None:
    """One evaluation round over ``evaluators``, with its events; leaves the model in its previous mode.

    A round during training opens with EVAL_BEFORE_ALL and closes with EVAL_AFTER_ALL; a ``standalone`` one
    (``Trainer.eval()``) with EVAL_STANDALONE_START and EVAL_STANDALONE_END instead, as in Composer.
    ``stop_requested`` is asked after every batch (on every rank: it may be a collective); when it says yes the
    round raises :class:`EvaluationInterrupted`, so a preempted job saves before its grace period runs out.
    ``subset_num_batches`` other than -1 limits every evaluator of this round (``Trainer.eval``'s); -1: each its own.
    """
    opening, closing = _ROUND_EVENTS[standalone]
    model = state.model
    was_training = model.training
    # Evaluation draws random numbers (e.g. a DataLoader iterator takes a seed); putting the generators back
    # afterwards keeps training independent of how often it evaluates, and resumes exact.
    training_rng = capture_rng_state()
    engine.run_event(opening)
    model.eval()
    try:
        with torch.no_grad():
            for evaluator in evaluators:
                limit = batch_limit(evaluator, subset_num_batches)
                _run_evaluator(state, engine, logger, evaluator, limit, stop_requested or _never)
    finally:
        state.dataloader_label = state.eval_batches = None
        model.train(was_training)
        restore_rng_state(training_rng)
    engine.run_event(closing)


def _never() -> bool:
    return False


_ROUND_EVENTS = {
    False: (Event.EVAL_BEFORE_ALL, Event.EVAL_AFTER_ALL),
    True: (Event.EVAL_STANDALONE_START, Event.EVAL_STANDALONE_END),
}


def _run_evaluator(
    state: State,
    engine: Engine,
    logger: Logger,
    evaluator: Evaluator,
    limit: int,
    stop_requested: Callable[[], bool],
) -> None:
    run_event, model, fabric = engine.run_event, state.model, require_fabric(state)
    # Pipeline stages run the model's forward through the pipeline (the outputs on the last stage, None elsewhere)
    pipelined = fabric.strategy.pipeline is not None
    has_eval_forward = hasattr(model.module, "eval_forward") and not pipelined
    eval_forward = getattr(model, "eval_forward", None) if has_eval_forward else None
    metrics = state.eval_metrics.get(evaluator.label, {})
    for metric in metrics.values():
        metric.reset()
    state.dataloader_label = evaluator.label
    state.eval_batches = batches_in(evaluator, limit)
    state.eval_timestamp = Timestamp()
    run_event(Event.EVAL_START)
    spec = evaluator.data_spec
    microbatch_size = evaluator.device_eval_microbatch_size
    in_use = evaluator.auto_microbatch_size if microbatch_size == "auto" else microbatch_size
    state.device_eval_microbatch_size = in_use  # type: ignore[assignment]
    for index, batch in enumerate(evaluator.loader):
        if index == limit:
            break
        state.batch = full_batch = spec.prepare(batch, fabric.to_device) if spec.transforms else batch
        run_event(Event.EVAL_BATCH_START)
        samples = spec.get_num_samples_in_batch(full_batch)
        if microbatch_size is None:
            forwards = [_forward(state, run_event, eval_forward, full_batch)]
        elif microbatch_size == "auto":
            forwards = _forward_auto(state, run_event, eval_forward, evaluator, samples)
        else:
            parts = spec.split_batch(full_batch, microbatch_size)  # type: ignore[arg-type]
            forwards = [_forward(state, run_event, eval_forward, part) for part in parts]
        if len(forwards) > 1:
            state.batch, state.outputs = full_batch, joined_outputs([outputs for _, outputs in forwards])
        for part, outputs in forwards:
            if pipelined and outputs is None:  # a stage before the last: its metrics count nothing
                continue
            part_samples = samples if len(forwards) == 1 else spec.get_num_samples_in_batch(part)
            for metric in metrics.values():
                state.metric_outputs = update_metric(model.module, part, outputs, metric, part_samples) or {}
        state.eval_timestamp = state.eval_timestamp.to_next_batch(samples * fabric.strategy.batch_shares)
        run_event(Event.EVAL_BATCH_END)
        if stop_requested():
            raise EvaluationInterrupted(f"evaluation {evaluator.label!r} stopped after {index + 1} batch(es)")
    values = compute_metrics(metrics, f"metrics/{evaluator.label}", by_name=state.eval_metric_values)
    state.metrics.update(values)
    logger.log_metrics(values)
    run_event(Event.EVAL_END)


def _forward(
    state: State, run_event: Callable[[Event], None], eval_forward: Callable[[Any], Any] | None, batch: Any
) -> tuple[Any, Any]:
    """One forward with its events; returns ``(batch, outputs)`` for the metrics."""
    state.batch = batch
    run_event(Event.EVAL_BEFORE_FORWARD)
    state.outputs = eval_forward(batch) if eval_forward is not None else state.model(batch)
    run_event(Event.EVAL_AFTER_FORWARD)
    return batch, state.outputs


def _forward_auto(
    state: State,
    run_event: Callable[[Event], None],
    eval_forward: Callable[[Any], Any] | None,
    evaluator: Evaluator,
    samples: int,
) -> list[tuple[Any, Any]]:
    """The batch's forwards at the evaluator's current microbatch size (first the whole batch). After an
    out-of-memory error on any rank every rank halves the size for what it has left: the forwards that gave
    outputs are kept (their events fired once), only the one that ran out of memory is run again, smaller.
    The size all ranks ended with is kept for the next batch."""
    fabric, spec = require_fabric(state), evaluator.data_spec
    size = evaluator.auto_microbatch_size or samples
    kept: list[tuple[Any, Any]] = []
    left = [state.batch]  # what this rank has still to run, in order
    while True:
        failure: BaseException | None = None
        parts = [part for chunk in left for part in spec.split_batch(chunk, size)]
        left = []
        for index, part in enumerate(parts):
            try:
                kept.append(_forward(state, run_event, eval_forward, part))
            except BaseException as error:
                if not is_out_of_memory(error):
                    raise
                failure, left = error, parts[index:]
                break
        any_failed = failure is not None
        if fabric.world_size > 1:  # every rank runs the same rounds, so the sizes stay the same on all
            flag = torch.tensor(float(any_failed), device=fabric.device)
            any_failed = bool(fabric.all_reduce(flag, reduce_op="max").item())
        if not any_failed:
            evaluator.auto_microbatch_size = state.device_eval_microbatch_size = size
            return kept
        if size == 1:
            raise RuntimeError(
                f"Out of memory with device_eval_microbatch_size=1 in evaluator {evaluator.label!r}: even one sample "
                "does not fit."
            ) from failure
        size = max(1, size // 2)


def batch_limit(evaluator: Evaluator, subset_num_batches: int = -1) -> int:
    """The most batches a round of ``evaluator`` runs (-1: all): ``subset_num_batches`` unless it is -1, else the
    evaluator's own (``None``, never resolved by a Trainer: all)."""
    if subset_num_batches != -1:
        return subset_num_batches
    return -1 if evaluator.subset_num_batches is None else evaluator.subset_num_batches


def batches_in(evaluator: Evaluator, limit: int) -> int | None:
    """How many batches a round of ``evaluator`` limited to ``limit`` batches (-1: all) runs on this rank; ``None``
    when its loader has no length."""
    length = loader_length(evaluator.loader)
    if limit == -1:
        return length
    return limit if length is None else min(length, limit)
