"""One training batch: microbatches, forward, loss, backward, optimizer steps, clock, with its events.

The loop sets the batch's learning rates (``TrainStep.lr_schedule``) before it fetches the batch,
so every event of batch ``k``, from BEFORE_DATALOADER on, sees the LR batch ``k`` trains with. Then
the events fire in this order (``state.batch`` is the microbatch between BEFORE_FORWARD and
AFTER_BACKWARD, the whole batch otherwise)::

    BATCH_START, BEFORE_TRAIN_BATCH,
    per microbatch: BEFORE_FORWARD, AFTER_FORWARD, BEFORE_LOSS, AFTER_LOSS, BEFORE_BACKWARD, AFTER_BACKWARD,
    AFTER_TRAIN_BATCH (gradients complete, synced and unscaled; before the optimizer step)

then the optimizers step, PyTorch LR schedulers step, and the timestamp advances. A run in which nothing listens to
the events from BEFORE_TRAIN_BATCH to AFTER_TRAIN_BATCH, with no microbatches, train metrics, gradient scaler,
token-weighted losses, pipeline or sequence split, computes each batch's gradients in one forward and backward without
them (chosen at every ``fit()``, given way to when the state asks for microbatches or metrics mid-run): it trains
exactly as the full sequence does, at fewer Python calls per batch.

Losses of microbatches are weighted by their share of the samples, so the gradient equals the full batch's;
DDP synchronises only on the last microbatch. With ``accumulate_on_tokens`` (Composer's
``accumulate_train_batch_on_tokens``) the share is of the loss-generating tokens instead, over every rank's
batch: each microbatch's mean loss is weighted by its tokens over the ranks' mean token count, so after DDP's
average the gradient is the mean over every token of the global batch, however unevenly padded. With
``microbatch_size="auto"`` an out-of-memory error halves the microbatch and the batch is retried, the decision
agreed across ranks.

Closure optimizers: when an optimizer's ``step`` requires a closure (``torch.optim.LBFGS``), every
optimizer steps as in Composer, ``optimizer.step(closure)``, where the closure zeroes the gradients and
runs BEFORE_TRAIN_BATCH .. AFTER_TRAIN_BATCH (forward, loss and backward of every microbatch, events
included) again, on the batch as it was at BATCH_START. So those events fire once per closure call
(LBFGS calls it up to ``max_iter`` times), BATCH_START and BATCH_END once per batch. ``state.loss`` is
the first call's loss (the loss at the weights the batch started with, what ``LBFGS.step`` returns);
train metrics count the batch once, from that first call. On several ranks the closure returns the
loss averaged over ranks, so every rank's line search decides alike (the gradients are averaged
already). GradScaler (``precision="16-mixed"``) and DeepSpeed cannot step with a closure: they are
refused when the Trainer is built.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from time import perf_counter
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from fabric.trainer.core.engine import Engine
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State, require_fabric
from fabric.trainer.core.time import advanced
from fabric.trainer.data_spec import DataSpec
from fabric.trainer.metrics import update_metric
from fabric.trainer.microbatch import is_out_of_memory
from fabric.trainer.schedulers import LRSchedule
from fabric.wrappers import FabricModule, unwrap_optimizer

if TYPE_CHECKING:
    from fabric.fabric import Fabric
    from fabric.plugins.precision.precision import Precision
    from fabric.trainer.parallelism import SequenceSplit
    from fabric.trainer.pipeline import PipelineLoss

TokenCounter = Callable[[Any], int]

#: The events between BATCH_START and the optimizer step: where nothing listens to them, the step runs plain.
_EVENTS_INSIDE_THE_STEP = (
    Event.BEFORE_TRAIN_BATCH,
    Event.BEFORE_FORWARD,
    Event.AFTER_FORWARD,
    Event.BEFORE_LOSS,
    Event.AFTER_LOSS,
    Event.BEFORE_BACKWARD,
    Event.AFTER_BACKWARD,
    Event.AFTER_TRAIN_BATCH,
)


def count_tokens(batch: Any) -> int:
    """Tokens in a batch: the elements of ``batch["input_ids"]`` for mapping batches, else 0."""
    if type(batch) is not tuple and type(batch) is not list and isinstance(batch, Mapping):  # skip the ABC check
        input_ids = batch.get("input_ids")
        if isinstance(input_ids, torch.Tensor):
            return int(input_ids.numel())
    return 0


class TrainStep:
    """Trains one batch; created once per Trainer so the per-batch path does no set-up work."""

    def __init__(
        self,
        state: State,
        engine: Engine,
        *,
        lr_schedule: LRSchedule | None,
        torch_schedulers: Sequence[LRScheduler],
        step_schedulers_every_batch: bool,
        microbatch_size: int | str | None,
        token_counter: TokenCounter = count_tokens,
        accumulate_on_tokens: bool = False,
        pipeline: PipelineLoss | None = None,
        sequence_split: SequenceSplit | None = None,
    ) -> None:
        self.state, self.engine = state, engine
        #: What a context-parallel mesh splits along the sequence around each microbatch, or None.
        self._sequence_split = sequence_split
        if sequence_split is not None:
            self._train_microbatch = self._train_sequence_parts  # type: ignore[method-assign]
        #: The loss of the model's pipeline stages (the batch runs in one call of the model), or None.
        self._pipeline = pipeline
        self.fabric = require_fabric(state)
        # Fixed once the processes joined, which the Trainer waits for before it builds its step.
        self._world_size = self.fabric.world_size
        self._batch_shares = self.fabric.strategy.batch_shares  # the ranks whose batches differ
        self.lr_schedule = lr_schedule
        self.torch_schedulers = tuple(torch_schedulers)
        self.step_schedulers_every_batch = step_schedulers_every_batch
        self.set_microbatch_size(microbatch_size)
        self.token_counter = token_counter
        self.accumulate_on_tokens = accumulate_on_tokens
        self._loss_total = 1.0  # the batch's samples or tokens, which each microbatch's weight divides
        self.data_spec = DataSpec(())
        self.refresh()
        self._update_metrics = True  # False for the repeated evaluations of a closure step

    def refresh(self) -> None:
        """Follow the state's optimizers, the strategy's precision and the model's methods (at every ``fit()``), and
        choose how a batch's gradients are computed."""
        self._unscale = self.fabric.strategy.precision.scales_gradients
        self.closure_step = check_closure_optimizers(self.state.optimizers, self.fabric)
        #: ``model.loss`` as the set-up model resolves it (marked, guarded or plain), for the model it was read from:
        #: read through the wrapper's ``__getattr__`` on every microbatch it cost more than the rest of the lookup.
        self._loss_method: tuple[FabricModule, Callable[..., Any]] | None = None
        unobserved = not any(self.engine.listens_to(event) for event in _EVENTS_INSIDE_THE_STEP)
        plain = self._pipeline is None and self._sequence_split is None and not self.auto_microbatching
        plain = plain and unobserved and not (self.accumulate_on_tokens or self._unscale or self.state.train_metrics)
        if plain:
            self._gradients = self._whole_batch_gradients  # type: ignore[method-assign]
        else:
            vars(self).pop("_gradients", None)

    def set_microbatch_size(self, microbatch_size: int | str | None) -> None:
        """Train with microbatches of ``microbatch_size`` samples (``"auto"``: halved on out-of-memory errors)."""
        self.auto_microbatching = microbatch_size == "auto"
        self.state.device_train_microbatch_size = None if self.auto_microbatching else microbatch_size  # type: ignore[assignment]

    @property
    def data_spec(self) -> DataSpec:
        """How to split and count the train batches; the Trainer sets it with the train dataloader."""
        return self._data_spec

    @data_spec.setter
    def data_spec(self, spec: DataSpec) -> None:
        self._data_spec = spec
        # The batch's counters, resolved once: a batch then costs one call for each (the checks of a user's counter
        # included, which the built-in ones need not: they count by construction).
        self._count_samples = spec.samples_counter()
        built_in = spec.num_tokens_function is None and self.token_counter is count_tokens
        counter = partial(spec.get_num_tokens_in_batch, default=self.token_counter)
        self._count_tokens: TokenCounter = count_tokens if built_in else counter

    @property
    def _model(self) -> FabricModule:
        """The state's model, which the Trainer set up with its Fabric before any batch trains."""
        return cast(FabricModule, self.state.model)

    def run(self, batch: Any) -> None:
        """Train on ``batch`` and advance the clock; the loop fired the dataloader events already."""
        state = self.state
        started = perf_counter()
        state.batch = batch
        self.engine.fire.batch_start()
        batch, strategy = state.batch, self.fabric.strategy  # the batch as BATCH_START left it, trained until applied
        while True:
            if state.train_metrics:  # each batch's values are its own (compute_metrics keeps them)
                for metric in state.train_metrics.values():
                    metric.reset()
            if self.closure_step:
                total_loss, full_batch, samples = self._step_with_closure(batch)
            else:
                total_loss, full_batch, samples = self._gradients(batch)
                for optimizer in state.optimizers:
                    optimizer.step()
            for optimizer in state.optimizers:
                optimizer.zero_grad(set_to_none=True)
            # The replica groups discarded the update (fault tolerance: a group failed during the step, or too few
            # took part): train the same batch again rather than count it, so no sample goes untrained and every
            # group's clock stays the run's committed step count.
            if not strategy.step_discarded:
                break
        if self.step_schedulers_every_batch:
            for scheduler in self.torch_schedulers:
                scheduler.step()
        state.loss = total_loss
        shares = self._batch_shares
        # Sharded loaders give every share equally sized batches, so the global count is local x shares (the ranks
        # of one tensor-parallel group train the same batch: counted once).
        state.timestamp = advanced(
            state.timestamp, samples * shares, self._count_tokens(full_batch) * shares, perf_counter() - started
        )

    def _gradients(self, batch: Any) -> tuple[torch.Tensor, Any, int]:
        """BEFORE_TRAIN_BATCH to AFTER_TRAIN_BATCH: the batch's gradients, complete and unscaled.

        Returns the (detached) loss, the batch as BEFORE_TRAIN_BATCH left it, and its number of samples.
        """
        state, fire = self.state, self.engine.fire
        state.batch = batch
        fire.before_train_batch()
        full_batch = state.batch
        samples = self._count_samples(full_batch)
        self._loss_total = self._tokens_over_ranks(full_batch) if self.accumulate_on_tokens else samples
        size = state.device_train_microbatch_size
        if self._pipeline is not None:
            total_loss = self._train_pipeline(self._pipeline, full_batch)
        elif self.auto_microbatching:
            total_loss = self._train_with_auto_microbatches(full_batch, samples)
        elif size is None or size >= samples:  # the whole batch in one pass, the common case
            total_loss = self._train_microbatch(
                full_batch, self._weight(full_batch) if self.accumulate_on_tokens else 1.0
            )
        else:
            total_loss = self._train_microbatches(full_batch, samples, size)
        state.batch = full_batch
        if self._unscale:
            for optimizer in state.optimizers:
                # The scaler tracks optimizers by identity and the step goes to the user's optimizer, not
                # Fabric's wrapper: unscaling the wrapper would make the step unscale a second time.
                self.fabric.strategy.precision.unscale_gradients(unwrap_optimizer(optimizer))
        fire.after_train_batch()
        return total_loss, full_batch, samples

    def _whole_batch_gradients(self, batch: Any) -> tuple[torch.Tensor, Any, int]:
        """:meth:`_gradients` where the step is plain (see :meth:`refresh`): the batch in one forward and backward,
        whose events nothing listens to, with no train metrics, gradient scaler, pipeline or sequence split."""
        state = self.state
        if state.train_metrics or state.device_train_microbatch_size is not None:  # set after the step was chosen
            return TrainStep._gradients(self, batch)
        state.batch = batch
        samples = self._count_samples(batch)
        model: FabricModule = state.model  # type: ignore[assignment]  # set up by the Trainer before any batch
        state.outputs = outputs = model(batch)
        resolved = self._loss_method
        if resolved is None or resolved[0] is not model:
            resolved = self._loss_method = (model, model.loss)
        state.loss = loss = resolved[1](outputs, batch)
        if isinstance(loss, torch.Tensor):
            self.fabric.backward(loss, model=model)
            return loss.detach(), batch, samples
        return self._backward_of(loss, 1.0).detach(), batch, samples

    def _step_with_closure(self, batch: Any) -> tuple[torch.Tensor, Any, int]:
        """Every optimizer steps with a closure that recomputes the gradients (see the module docstring)."""
        optimizers, fabric = self.state.optimizers, self.fabric
        first: list[tuple[torch.Tensor, Any, int]] = []

        def closure() -> Any:  # a tensor: what closures return, though Optimizer.step's hint says float
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            self._update_metrics = not first
            result = self._gradients(batch)
            if not first:
                first.append(result)
            loss = result[0]
            return fabric.all_reduce(loss, reduce_op="mean") if fabric.world_size > 1 else loss

        try:
            for optimizer in optimizers:
                optimizer.step(closure)
        finally:
            self._update_metrics = True
        return first[0]

    def _tokens_over_ranks(self, batch: Any) -> float:
        """The loss-generating tokens of this batch, averaged over the ranks (every rank's weights divide by it)."""
        tokens = float(self.data_spec.get_num_tokens_in_batch(batch, self.token_counter, "loss_generating"))
        if self._world_size > 1:
            tokens = self.fabric.all_reduce(torch.tensor(tokens), reduce_op="mean").item()
        if tokens == 0:
            raise ValueError(
                "accumulate_train_batch_on_tokens=True, but the batch has no loss-generating tokens on any rank: "
                "count them with get_num_tokens_in_batch (a number, or {'total': ..., 'loss_generating': ...})."
            )
        return tokens

    def _weight(self, microbatch: Any) -> float:
        """The factor of a microbatch's mean loss: its share of the batch's samples, or of the ranks' tokens."""
        if self.accumulate_on_tokens:
            tokens = self.data_spec.get_num_tokens_in_batch(microbatch, self.token_counter, "loss_generating")
            return tokens / self._loss_total
        return self.data_spec.get_num_samples_in_batch(microbatch) / self._loss_total

    def _train_microbatches(self, batch: Any, samples: int, microbatch_size: int | None) -> torch.Tensor:
        if microbatch_size is None or microbatch_size >= samples:
            return self._train_microbatch(batch, self._weight(batch) if self.accumulate_on_tokens else 1.0)
        microbatches = self.data_spec.split_batch(batch, microbatch_size)
        last = len(microbatches) - 1
        total_loss: torch.Tensor | None = None
        for index, microbatch in enumerate(microbatches):
            with self.fabric.no_backward_sync(self._model, enabled=index < last):
                loss = self._train_microbatch(microbatch, self._weight(microbatch))
            total_loss = loss if total_loss is None else total_loss + loss
        assert total_loss is not None
        return total_loss

    def _train_sequence_parts(self, microbatch: Any, weight: float) -> torch.Tensor:
        """:meth:`_train_microbatch` on this rank's part of each sequence (context parallelism; the tensors are whole
        again after it)."""
        assert self._sequence_split is not None
        tensors, dims = self._sequence_split.tensors(microbatch, self._model.module)
        with self.fabric.context_parallel(tensors, seq_dims=dims):
            return TrainStep._train_microbatch(self, microbatch, weight)

    def _train_microbatch(self, microbatch: Any, weight: float) -> torch.Tensor:
        state, fire = self.state, self.engine.fire
        model: FabricModule = state.model  # type: ignore[assignment]  # set up by the Trainer before any batch
        state.batch = microbatch
        fire.before_forward()
        state.outputs = model(state.batch)
        fire.after_forward()
        fire.before_loss()
        resolved = self._loss_method
        if resolved is None or resolved[0] is not model:
            resolved = self._loss_method = (model, model.loss)
        state.loss = resolved[1](state.outputs, state.batch)
        fire.after_loss()
        fire.before_backward()
        loss = state.loss
        if isinstance(loss, torch.Tensor):  # the common case, ahead of the loss's other forms
            total = loss
            self.fabric.backward(loss * weight if weight != 1.0 else loss, model=model)
        else:
            total = self._backward_of(loss, weight)
        fire.after_backward()
        if state.train_metrics and self._update_metrics:
            samples = self.data_spec.get_num_samples_in_batch(state.batch)
            with torch.no_grad():
                for metric in state.train_metrics.values():
                    update_metric(model.module, state.batch, state.outputs, metric, samples)
        detached = total.detach()
        return detached * weight if weight != 1.0 else detached

    def _train_pipeline(self, pipeline: PipelineLoss, batch: Any) -> torch.Tensor:
        """Forward, loss and backward of every microbatch in the pipeline's one call, the events of a microbatch
        around it (see :mod:`fabric.trainer.pipeline`); the metrics from the last stage's microbatches."""
        state, fire = self.state, self.engine.fire
        state.batch = batch
        fire.before_forward()
        batch = state.batch
        loss: torch.Tensor = self._model(batch, target=pipeline.start(batch))
        outputs = pipeline.outputs()
        state.outputs, state.loss = outputs, loss
        for event in ("after_forward", "before_loss", "after_loss", "before_backward", "after_backward"):
            getattr(fire, event)()
            changed = [
                name
                for name, value in (("batch", batch), ("outputs", outputs), ("loss", loss))
                if getattr(state, name) is not value
            ]
            if changed:
                raise RuntimeError(
                    f"An algorithm or callback replaced state.{changed[0]} at {event.upper()}, but under pipeline "
                    "parallelism the forward, loss and backward of the batch ran before that event, in one call of "
                    "the pipeline: the change could not take effect. Change the batch at BEFORE_FORWARD, or leave "
                    "this algorithm out."
                )
        if state.train_metrics:
            with torch.no_grad():
                for microbatch, microbatch_outputs in pipeline.microbatches:
                    samples = self.data_spec.get_num_samples_in_batch(microbatch)
                    for metric in state.train_metrics.values():
                        update_metric(self._model.module, microbatch, microbatch_outputs, metric, samples)
        return loss

    def _backward_of(self, loss: Any, weight: float) -> torch.Tensor:
        """The backward of a loss that is not one tensor: one per optimizer, a dict or a list (see
        :func:`_total_loss`); returns the (undetached) total."""
        if (losses := _per_optimizer_losses(loss, len(self.state.optimizers))) is not None:
            return self._backward_per_optimizer(losses, weight)
        total = _total_loss(loss)
        self.fabric.backward(total * weight if weight != 1.0 else total, model=self._model)
        return total

    def _backward_per_optimizer(self, losses: Sequence[torch.Tensor], weight: float) -> torch.Tensor:
        """Loss ``i`` gives gradients to optimizer ``i``'s parameters only (a GAN's discriminator and generator)."""
        last = len(losses) - 1
        for index, (loss, optimizer) in enumerate(zip(losses, self.state.optimizers, strict=True)):
            inputs = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
            self.fabric.backward(loss * weight, model=self._model, inputs=inputs, retain_graph=index < last)
        return torch.stack([loss.detach() for loss in losses]).sum()

    def _train_with_auto_microbatches(self, batch: Any, samples: int) -> torch.Tensor:
        """Try the batch at the current microbatch size; on out-of-memory (on any rank) halve it and retry."""
        state, fabric = self.state, self.fabric
        distributed = fabric.world_size > 1
        if state.device_train_microbatch_size is None:
            state.device_train_microbatch_size = samples
        while True:
            size = state.device_train_microbatch_size
            failure: BaseException | None = None
            try:
                # Gradients are synced by hand below, after every rank agreed the batch fitted.
                with fabric.no_backward_sync(self._model, enabled=distributed):
                    total_loss = self._train_microbatches(batch, samples, size)
            except BaseException as error:
                if not is_out_of_memory(error):
                    raise
                failure = error
            any_failed = failure is not None
            if distributed:
                flag = torch.tensor(float(any_failed), device=fabric.device)
                any_failed = bool(fabric.all_reduce(flag, reduce_op="max").item())
            if not any_failed:
                if distributed:
                    _all_reduce_gradients(fabric, state.optimizers)
                return total_loss
            for optimizer in state.optimizers:
                optimizer.zero_grad(set_to_none=True)
            if size == 1:
                raise RuntimeError(
                    "Out of memory with device_train_microbatch_size=1: even one sample does not fit."
                ) from failure
            state.device_train_microbatch_size = max(1, size // 2)


def _all_reduce_gradients(fabric: Fabric, optimizers: Sequence[Optimizer]) -> None:
    """Average gradients over ranks in one flat all-reduce (what DDP would have done in the backward)."""
    grads = [
        p.grad
        for optimizer in optimizers
        for group in optimizer.param_groups
        for p in group["params"]
        if p.grad is not None
    ]
    if not grads:
        return
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    flat = fabric.all_reduce(flat, reduce_op="mean")
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def check_closure_optimizers(
    optimizers: Sequence[Optimizer], fabric: Fabric, precision: Precision | None = None
) -> bool:
    """Whether an optimizer's ``step`` requires a closure (LBFGS); raises where the set-up (with ``precision``, a
    precision plugin about to replace the strategy's, if given) cannot step with one."""
    needing = [
        type(inner).__name__ for optimizer in optimizers if _requires_closure(inner := unwrap_optimizer(optimizer))
    ]
    if not needing:
        return False
    if fabric.strategy.engine_handles_gradients:
        cause = "DeepSpeed steps through its engine, which takes no closure"
    elif (precision or fabric.strategy.precision).scales_gradients:
        cause = "precision='16-mixed' steps through a GradScaler, which takes no closure"
    elif fabric.strategy.pipeline is not None:
        cause = "pipeline stages compute the gradients inside the pipeline's step, which takes no closure"
    else:
        return True
    raise ValueError(
        f"{needing[0]} steps with a closure that recomputes the loss, but {cause}. Use precision='32-true' or "
        "'bf16-mixed' without DeepSpeed or pipeline stages, or an optimizer that steps without a closure."
    )


def _requires_closure(optimizer: Optimizer) -> bool:
    closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def _total_loss(loss: Any) -> torch.Tensor:
    """One tensor to differentiate: the tensor itself, a dict's ``"total"`` (or the sum of its values), or a sum."""
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(loss, Mapping):
        return loss["total"] if "total" in loss else sum(loss.values())  # type: ignore[return-value]
    if isinstance(loss, (list, tuple)):
        return sum(loss)  # type: ignore[return-value]
    raise TypeError(
        f"model.loss() returned a {type(loss).__name__}; expected a tensor, a dict of tensors or a list of tensors."
    )


def pipelined_loss(loss: Any, num_optimizers: int) -> torch.Tensor:
    """``model.loss``'s value as the one tensor a pipeline's last stage differentiates per microbatch."""
    if _per_optimizer_losses(loss, num_optimizers) is not None:
        raise TypeError(
            f"model.loss() returned one loss per optimizer ({num_optimizers}): under pipeline parallelism the "
            "backward runs inside the pipeline, for one loss; return one tensor (or a dict with 'total')."
        )
    return _total_loss(loss)


def _per_optimizer_losses(loss: Any, num_optimizers: int) -> Sequence[torch.Tensor] | None:
    """A list/tuple with one loss per optimizer (two or more) means: loss ``i`` trains optimizer ``i``."""
    if num_optimizers > 1 and isinstance(loss, (list, tuple)) and len(loss) == num_optimizers:
        return loss
    return None
