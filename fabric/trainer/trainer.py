"""``Trainer``: a ready training loop on Fabric that algorithms and callbacks bend through events.

The common case is short::

    trainer = Trainer(model=model, train_dataloader=train_loader, eval_dataloader=eval_loader,
                      max_duration="10ep", optimizers=torch.optim.AdamW(model.parameters()),
                      precision="amp_bf16", devices=2, strategy="ddp")
    trainer.fit()

The model is any ``nn.Module`` with ``forward(batch)`` and ``loss(outputs, batch)`` (see
:mod:`fabric.trainer.model`). Where every event fires is documented in :mod:`fabric.trainer.core.events`,
:mod:`fabric.trainer.train_step` and :mod:`fabric.trainer.evaluation`.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, TextIO

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from fabric.fabric import Fabric
from fabric.plugins.io.checkpoint_io import StorageOptions
from fabric.strategies.strategy import Strategy
from fabric.trainer.callbacks._utils import user_model
from fabric.trainer.checkpoint.checkpointer import find_resume_checkpoint, read_surgery_records
from fabric.trainer.checkpoint.parts import SelectiveCheckpointer, matched_parts
from fabric.trainer.checkpoint.preemption import PreemptionWatch, TrainingPreempted
from fabric.trainer.checkpoint.saver import CheckpointSaver
from fabric.trainer.checkpoint.trainer_state import DataPosition, TrainerCheckpointState
from fabric.trainer.clock_check import ClockCheck
from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.callback import Callback
from fabric.trainer.core.engine import Engine
from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.passes import AlgorithmPass
from fabric.trainer.core.state import State, loader_length, require_fabric
from fabric.trainer.core.time import Time, Timestamp, batches_in_epoch
from fabric.trainer.data_spec import DataSpec, ensure_data_spec
from fabric.trainer.epoch import EpochCursor
from fabric.trainer.evaluation import (
    EvaluationInterrupted,
    Evaluator,
    batch_limit,
    batches_in,
    run_evaluators,
    select_metrics,
)
from fabric.trainer.export import export_for_inference
from fabric.trainer.intervals import IntervalFunction, IntervalInput, create_eval_interval
from fabric.trainer.loggers.wiring import LoggerInput, connect_loggers
from fabric.trainer.metrics import compute_metrics, model_metrics
from fabric.trainer.migration import check_subset_num_batches, microbatch_size_for, without_excluded
from fabric.trainer.pipeline import PipelineLoss
from fabric.trainer.plan import (
    LoadPlan,
    StagePlan,
    TrainerPlan,
    plan_evaluators,
    plan_stage,
    plan_trainer,
    scaled,
)
from fabric.trainer.prediction import run_prediction
from fabric.trainer.profiler import Profiler
from fabric.trainer.schedulers import LRSchedule
from fabric.trainer.stages import (
    check_schedulers_follow,
    default_optimizer,
    rebound_schedule,
    restarted_interval,
    setup_new_optimizers,
    switch_precision,
    warn_default_optimizer,
)
from fabric.trainer.surgery import reapply_surgery
from fabric.trainer.train_step import TokenCounter, TrainStep, check_closure_optimizers, pipelined_loss
from fabric.utilities.seed import configure_deterministic_mode


class Trainer:
    """Trains, evaluates and predicts with ``model`` on a Fabric, firing events around every step.

    Fabric: pass ``accelerator``/``devices``/``strategy``/``precision``/``num_nodes`` (Fabric's strings;
    precision also takes Composer's ``"fp32"``, ``"amp"``, ``"amp_fp16"``, ``"amp_bf16"``, ``"amp_fp8"``) or a ready
    ``fabric=``.
    With ``strategy="ddp"`` and no launcher, constructing the Trainer starts the other local ranks.
    Composer's names (``device``, ``deepspeed_config``, ``parallelism_config``, ``dist_timeout``,
    ``deterministic_mode``, ``compile_config``, ``load_path_format``, ``grad_accum``, ...) mean what they mean in
    Composer or are refused by name (see :mod:`fabric.trainer.migration`).

    Training: ``max_duration`` (a Time, ``"10ep"``, or an int meaning epochs), ``optimizers`` (one or a
    list; several optimizers all step after the backward, or, when ``loss`` returns one loss per
    optimizer, loss ``i`` trains optimizer ``i``; none given: Composer's ``DecoupledSGDW(lr=0.1)``),
    ``schedulers`` (``fabric.trainer.schedulers``, which follow the clock every batch, or PyTorch ``LRScheduler``
    objects, stepped every epoch, as in Composer, unless ``step_schedulers_every_batch=True``),
    ``scale_schedule_ratio`` (scales max_duration and the schedules),
    ``device_train_microbatch_size`` (int, or ``"auto"`` to halve on out-of-memory errors),
    ``accumulate_train_batch_on_tokens`` (weight microbatch losses by loss-generating tokens, over all ranks,
    instead of samples), ``train_subset_num_batches`` (at most that many batches per epoch). :meth:`fit` takes most
    of these again for the next stage of training.

    Evaluation: ``eval_dataloader`` (a dataloader, an :class:`Evaluator`, a dict ``{label: loader}`` or
    a list), every ``eval_interval`` (Time, int epochs, or ``(state, event) -> bool``; also at the end of
    training), ``eval_subset_num_batches``. ``profiler``: a :class:`~fabric.trainer.profiler.Profiler`
    (``torch.profiler`` traces per rank on a batch schedule). Any dataloader argument also takes a
    :class:`~fabric.trainer.data_spec.DataSpec` (custom batch types: transforms, splitting, counting).
    Algorithms, callbacks and loggers hook the events; the
    tqdm progress bar is added on rank 0 unless ``progress_bar=False``.

    Checkpoints: ``save_folder`` and ``load_path`` are local paths or fsspec URLs (``s3://bucket/run``);
    ``storage_options`` go to fsspec for them (an S3-compatible store's endpoint and credentials, e.g.
    ``{"client_kwargs": {"endpoint_url": "http://minio:9000"}, "key": ..., "secret": ...}``).
    ``save_async=True`` takes a CPU snapshot at each save and writes it in the background while training
    goes on (one save in flight; an error surfaces at the next save or at the end of ``fit()``).
    ``save_ignore_keys``/``load_ignore_keys`` take Composer's checkpoint paths (``"state/optimizers"``, ``"rng"``),
    ``save_metrics`` saves the metrics (see :mod:`fabric.trainer.checkpoint.parts`).
    """

    def __init__(
        self,
        model: nn.Module,
        train_dataloader: Iterable[Any] | DataSpec | None = None,
        max_duration: Time[Any] | str | int | None = None,
        *,
        optimizers: Optimizer | Sequence[Optimizer] | None = None,
        schedulers: Any = None,
        scale_schedule_ratio: float = 1.0,
        step_schedulers_every_batch: bool | None = None,
        eval_dataloader: Any = None,
        eval_interval: IntervalInput = 1,
        eval_subset_num_batches: int = -1,
        train_subset_num_batches: int = -1,
        spin_dataloaders: bool = True,
        algorithms: Algorithm | Sequence[Algorithm] = (),
        algorithm_passes: AlgorithmPass | Sequence[AlgorithmPass | tuple[AlgorithmPass, int]] | None = None,
        callbacks: Callback | Sequence[Callback] = (),
        profiler: Profiler | None = None,
        loggers: LoggerInput | Sequence[LoggerInput] = (),
        progress_bar: bool = True,
        log_to_console: bool = False,
        console_log_interval: IntervalInput = "1ba",
        console_stream: str | TextIO = "stderr",
        device_train_microbatch_size: int | str | None = None,
        seed: int | None = None,
        get_num_tokens_in_batch: TokenCounter | None = None,
        accumulate_train_batch_on_tokens: bool = False,
        run_name: str | None = None,
        save_folder: str | None = None,
        save_interval: IntervalInput = "1ep",
        save_filename: str = "ep{epoch}-ba{batch}-rank{rank}.pt",
        save_latest_filename: str | None = "latest-rank{rank}.pt",
        save_num_checkpoints_to_keep: int = -1,
        save_weights_only: bool = False,
        save_overwrite: bool = False,
        save_async: bool = False,
        save_ignore_keys: Sequence[str] | None = (),
        save_metrics: bool = False,
        load_path: str | None = None,
        load_weights_only: bool = False,
        load_strict: bool = True,
        load_strict_model_weights: bool | None = None,
        load_ignore_keys: Sequence[str] | None = (),
        load_exclude_algorithms: Sequence[str] = (),
        autoresume: bool = False,
        storage_options: dict[str, Any] | None = None,
        fabric: Fabric | None = None,
        device: str | None = None,
        deepspeed_config: dict[str, Any] | None = None,
        parallelism_config: Mapping[str, Any] | None = None,
        dist_timeout: float | None = None,
        deterministic_mode: bool = False,
        compile_config: Mapping[str, Any] | None = None,
        load_path_format: str | None = None,
        grad_accum: int | str | None = None,
        **fabric_choices: Any,
    ) -> None:
        plan = plan_trainer({name: value for name, value in locals().items() if name != "self"})
        self.settings, self.scale_schedule_ratio = plan.settings, plan.scale_schedule_ratio
        self.storage_options = plan.storage_options
        if plan.deterministic_mode:
            configure_deterministic_mode()  # before anything runs a kernel, as in Composer
        self.fabric = plan.make_fabric()
        self.seed, self.run_name = _join_processes(self.fabric, plan.seed, plan.run_name)
        self.state = _initial_state(plan, self.fabric, self.run_name)
        self.logger, self.engine = _start_engine(self.state, self.fabric, plan.loggers, plan.progress_bar, plan.passes)
        #: Whether each batch's loss is averaged over the ranks (see :meth:`_after_batch`): fixed once they joined.
        self._reduces_loss = bool(self.logger.destinations) or self.fabric.world_size > 1
        load = self._checkpoint_to_load(plan)
        self._set_up_training(plan, load)
        self._clock_check = ClockCheck()
        self._epoch = EpochCursor(self.state, self.engine.run_event)
        if plan.train_data is not None:
            self._set_train_dataloader(plan.train_data)
        self._set_evaluators(plan.evaluators)
        self._apply_grad_accum()
        self._closed = False
        self._reported_failure: BaseException | None = None
        self._set_up_checkpointing(plan)
        self._load_at_start(load)
        if plan.optimizer_defaulted:  # said only once every argument proved valid: never before a configuration error
            warn_default_optimizer(plan.optimizers[0] if plan.optimizers else None)
        if load.resumed and self.fabric.is_global_zero:
            print(
                f"fabric: autoresume: resumed run {self.run_name!r} from {load.path} at {self._position()}.",
                file=sys.stderr,
            )

    def _checkpoint_to_load(self, plan: TrainerPlan) -> LoadPlan:
        """``load_path``'s checkpoint, or with ``autoresume`` the newest of this run, which wins (load_path starts
        a run, autoresume continues it)."""
        if not plan.autoresume:
            return plan.load
        save = plan.save
        assert save is not None  # the plan checked that autoresume has a save_folder
        found = None
        if self.fabric.is_global_zero:
            found = find_resume_checkpoint(
                save.folder,
                save.filename,
                save.latest_filename,
                self.run_name,
                plan.storage_options,
                self.fabric.strategy.replica_group,
            )
        found = self.fabric.broadcast(found)
        return plan.load if found is None else plan.load.resumed_from(found)

    def _set_up_training(self, plan: TrainerPlan, load: LoadPlan) -> None:
        """The model and optimizers set up with Fabric (after re-applying a checkpoint's surgery), the schedulers,
        the train metrics and the train step."""
        state = self.state
        if load.path is not None:  # surgery the checkpoint was saved with, and this run does not do itself
            surgery = without_excluded(read_surgery_records(load.path, plan.storage_options), load.excluded_algorithms)
            reapply_surgery(state.model, surgery, state.optimizers, state.algorithms)
        pipeline = _pipeline_loss(self.fabric.strategy, state)
        state.model, state.optimizers = _setup_model(self.fabric, state.model, state.optimizers, plan.compile_options)
        lr_schedule, torch_schedulers = self._setup_schedulers(
            plan.schedulers, state.optimizers, plan.scale_schedule_ratio
        )
        state.schedulers = _all_schedulers(lr_schedule, torch_schedulers)
        state.train_metrics = model_metrics(state.model.module, True, self.fabric)
        self._train_step = TrainStep(
            state,
            self.engine,
            lr_schedule=lr_schedule,
            torch_schedulers=torch_schedulers,
            step_schedulers_every_batch=_steps_every_batch(plan.settings.step_schedulers_every_batch, torch_schedulers),
            microbatch_size=plan.settings.device_train_microbatch_size,
            token_counter=plan.token_counter,
            accumulate_on_tokens=plan.accumulate_on_tokens,
            pipeline=pipeline,
            sequence_split=plan.sequence_split,
        )

    def _set_up_checkpointing(self, plan: TrainerPlan) -> None:
        """The checkpointer every saver saves with, the state a joining replica group receives, and the SIGTERM
        watch (with a saver: a preemption saves before the job ends)."""
        state = self.state
        self.checkpointer, self.saver = _setup_checkpointing(
            state,
            self.run_name,
            plan.storage_options,
            plan.save_ignore_keys,
            plan.save_metrics,
            data_position=self._epoch.position,
            on_load_position=self._epoch.resume_at,
        )
        epoch = self._epoch
        _share_with_joining_replicas(self.fabric, state, epoch.position_after_this_batch, epoch.resume_at)
        self._preemption = PreemptionWatch() if self.saver is not None else None

    def _load_at_start(self, load: LoadPlan) -> None:
        """Load the planned checkpoint; without one the load events fire all the same, as in Composer."""
        self.engine.run_event(Event.BEFORE_LOAD)
        if load.path is not None:  # the plan checked load_ignore_keys: only translated into parts here
            parts = matched_parts(load.ignore_keys)
            self.checkpointer.load_skipping(load.path, parts, weights_only=load.weights_only, strict=load.strict)
        self.engine.run_event(Event.AFTER_LOAD)

    @property
    def step_schedulers_every_batch(self) -> bool:
        """Whether the PyTorch schedulers step every batch (else every epoch): see :func:`_steps_every_batch`."""
        return self._train_step.step_schedulers_every_batch

    # --- set-up parts, also used after __init__ ---------------------------------------------------

    @staticmethod
    def _setup_schedulers(
        schedulers: Sequence[Any], optimizers: list[Optimizer], scale_schedule_ratio: float
    ) -> tuple[LRSchedule | None, list[LRScheduler]]:
        torch_schedulers = [scheduler for scheduler in schedulers if isinstance(scheduler, LRScheduler)]
        ours = [scheduler for scheduler in schedulers if not isinstance(scheduler, LRScheduler)]
        if not ours:  # the plan refused ours without optimizers (check_schedulers_have_optimizers)
            return None, torch_schedulers
        return LRSchedule(ours, optimizers, scale_schedule_ratio=scale_schedule_ratio), torch_schedulers

    def _install_schedulers(self, lr_schedule: LRSchedule | None, torch_schedulers: Sequence[LRScheduler]) -> None:
        """Train with these schedulers from now on (the checkpoints save theirs)."""
        self.state.schedulers = _all_schedulers(lr_schedule, torch_schedulers)
        self._train_step.lr_schedule = lr_schedule
        self._train_step.torch_schedulers = tuple(torch_schedulers)
        self.checkpointer.trainer_state.schedulers = list(self.state.schedulers)
        self._set_scheduler_stepping()

    def _set_scheduler_stepping(self) -> None:
        """Step the current PyTorch schedulers every batch or every epoch, as given or by default."""
        train_step = self._train_step
        train_step.step_schedulers_every_batch = _steps_every_batch(
            self.settings.step_schedulers_every_batch, train_step.torch_schedulers
        )

    def _set_train_dataloader(self, spec: DataSpec) -> None:
        """Train on ``spec``'s dataloader from the next epoch (the plan checked it against the settings)."""
        self._train_step.data_spec = spec
        loader = self._setup_dataloader(spec)
        self.state.dataloader = loader
        self._epoch.batches = None
        self.state.dataloader_len = self._epoch_length(loader)

    def _epoch_length(self, loader: Iterable[Any]) -> int | None:
        """Batches per epoch: the loader's length, or ``train_subset_num_batches`` when that is fewer (or the loader
        has none)."""
        length = loader_length(loader)
        subset = self.settings.train_subset_num_batches
        if subset == -1:
            return length
        return subset if length is None else min(length, subset)

    def _set_evaluators(self, evaluators: Sequence[Evaluator]) -> None:
        """Evaluate with ``evaluators`` (checked against the Fabric by the plan, or by :func:`plan_evaluators`)."""
        # Each evaluator's own subset (None: the Trainer's), so that fit(eval_subset_num_batches=) changes the rest.
        self._own_eval_subsets = [evaluator.subset_num_batches for evaluator in evaluators]
        self._prepare_evaluators(evaluators)
        self.evaluators = evaluators
        self._apply_eval_settings()

    def _prepare_evaluators(self, evaluators: Sequence[Evaluator]) -> None:
        """Each evaluator's loader set up with Fabric, and its metrics (its own copies) in ``state.eval_metrics``."""
        for evaluator in evaluators:
            evaluator.loader = self._setup_dataloader(evaluator.data_spec)
            eval_metrics = model_metrics(self.state.model.module, False, self.fabric)
            self.state.eval_metrics[evaluator.label] = select_metrics(eval_metrics, evaluator)

    def _apply_eval_settings(self) -> None:
        """The Trainer's ``eval_subset_num_batches`` and ``eval_interval`` for the evaluators without their own."""
        settings = self.settings
        for evaluator, own in zip(self.evaluators, self._own_eval_subsets, strict=True):
            evaluator.subset_num_batches = settings.eval_subset_num_batches if own is None else own
        evaluators = self.evaluators
        # One interval per evaluator: an interval fires once per batch, so a shared one would run only the first.
        self._evaluator_intervals = [
            create_eval_interval(settings.eval_interval)
            if evaluator.eval_interval is None
            else create_eval_interval(evaluator.eval_interval, name=f"{evaluator.label} eval_interval")
            for evaluator in evaluators
        ]

    def _setup_dataloader(self, spec: DataSpec) -> Iterable[Any]:
        """A DataLoader set up with Fabric (yielding batches unmoved when ``batch_transforms`` come first)."""
        if not isinstance(spec.dataloader, DataLoader):
            return spec.dataloader
        return self.fabric.setup_dataloaders(spec.dataloader, move_to_device=spec.batch_transforms is None)

    # --- training -------------------------------------------------------------------------------

    def fit(
        self,
        *,
        train_dataloader: Iterable[Any] | DataSpec | None = None,
        train_dataloader_label: str = "train",
        train_subset_num_batches: int | None = None,
        spin_dataloaders: bool | None = None,
        duration: Time[Any] | str | int | None = None,
        reset_time: bool = False,
        schedulers: Any = None,
        scale_schedule_ratio: float = 1.0,
        step_schedulers_every_batch: bool | None = None,
        eval_dataloader: Any = None,
        eval_subset_num_batches: int | None = None,
        eval_interval: IntervalInput | None = None,
        optimizers: Optimizer | Sequence[Optimizer] | None = None,
        precision: str | None = None,
        device_train_microbatch_size: int | str | None = None,
    ) -> None:
        """Train until ``max_duration``. Arguments change the Trainer for this and later fits, as Composer's ``fit``
        does, so training runs in stages (``fit(duration="2ep")``, then ``fit(train_dataloader=finetune,
        duration="1ep", reset_time=True, optimizers=new)``):

        * ``train_dataloader`` replaces the train dataloader; ``train_subset_num_batches``, ``spin_dataloaders`` and
          ``device_train_microbatch_size`` replace the Trainer's (``"auto"`` allowed).
        * ``duration``: train that much longer: ``max_duration`` becomes the current time (in ``duration``'s unit)
          plus ``duration``. ``reset_time=True`` first sets the clock to zero (a new epoch starts), so
          ``max_duration`` is ``duration``.
        * ``optimizers`` replace the Trainer's, set up with its Fabric (see :mod:`fabric.trainer.stages`; refused
          under DeepSpeed). The Trainer's schedule functions then schedule them; PyTorch schedulers of the old
          optimizers must be replaced with ``schedulers``.
        * ``schedulers`` replace the Trainer's; ``scale_schedule_ratio`` scales them and the whole ``max_duration``
          (Composer's rule: it needs ``schedulers``); ``step_schedulers_every_batch`` replaces the Trainer's.
        * ``eval_dataloader`` replaces the evaluators; ``eval_subset_num_batches`` and ``eval_interval`` replace the
          Trainer's for the evaluators without their own (also without a new ``eval_dataloader``).
        * ``precision`` switches between ``"fp32"``, ``"amp_fp16"``/``"amp"`` and ``"amp_bf16"`` (Fabric's
          ``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``) on one device or DDP, for this and later fits.

        ``train_dataloader_label`` is Composer's; only its default ``"train"`` is accepted. Every argument is checked
        before anything changes. If training raises, the loggers hear of it first (``log_exception``: trackers mark
        the run failed).
        """
        arguments = {name: value for name, value in locals().items() if name != "self"}
        with self._failures_logged():
            plan = plan_stage(
                arguments,
                self.settings,
                self.fabric,
                train_loader=self.state.dataloader,
                evaluates=bool(self.evaluators),
                has_optimizers=bool(self.state.optimizers),
            )
            self._start_stage(plan)
            self._fit()

    def _start_stage(self, plan: StagePlan) -> None:
        """Apply ``fit()``'s checked arguments (see :meth:`fit`): the new optimizers and schedulers are set up
        first, then the Trainer changes."""
        state = self.state
        new_optimizers, lr_schedule, torch_schedulers = self._stage_optimizers(plan)
        old_settings, self.settings = self.settings, plan.settings
        if plan.train_data is not None:  # first the train dataloader, whose set-up may still fail
            self._set_train_dataloader(plan.train_data)
        elif old_settings.train_subset_num_batches != plan.settings.train_subset_num_batches and state.dataloader:
            state.dataloader_len = self._epoch_length(state.dataloader)
        if plan.reset_time:
            self._restart_clock()
        if plan.extra_duration is not None:
            extra = plan.extra_duration
            state.max_duration = Time(int(state.timestamp.get(extra.unit)) + int(extra.value), extra.unit)
        if plan.scale_schedule_ratio != 1.0 and state.max_duration is not None:
            state.max_duration = scaled(state.max_duration, plan.scale_schedule_ratio)
        if new_optimizers is not None:
            state.optimizers = new_optimizers
        if plan.schedulers is not None or new_optimizers is not None:
            self._install_schedulers(lr_schedule, torch_schedulers)
        self._set_scheduler_stepping()
        if plan.evaluators is not None:
            self._set_evaluators(plan.evaluators)
        elif {"eval_interval", "eval_subset_num_batches"} & plan.given_settings:
            self._apply_eval_settings()
        if "device_train_microbatch_size" in plan.given_settings:
            self._train_step.set_microbatch_size(plan.settings.device_train_microbatch_size)
        if plan.precision is not None:
            switch_precision(self.fabric, plan.precision)
        self._train_step.refresh()

    def _stage_optimizers(self, plan: StagePlan) -> tuple[list[Optimizer] | None, LRSchedule | None, list[LRScheduler]]:
        """The next stage's new optimizers (None: the Trainer's stay) and schedulers, set up and checked against
        each other and the precision, before the Trainer changes."""
        new_optimizers = None
        if plan.optimizers is not None:
            new_optimizers = setup_new_optimizers(self.fabric, self.state.model, plan.optimizers)
        training = self.state.optimizers if new_optimizers is None else new_optimizers
        lr_schedule, torch_schedulers = self._train_step.lr_schedule, list(self._train_step.torch_schedulers)
        if plan.schedulers is not None:
            lr_schedule, torch_schedulers = self._setup_schedulers(plan.schedulers, training, plan.scale_schedule_ratio)
        elif new_optimizers is not None:
            lr_schedule = rebound_schedule(lr_schedule, new_optimizers)
        if new_optimizers is not None:
            check_schedulers_follow(torch_schedulers, new_optimizers)
        if new_optimizers is not None or plan.precision is not None:
            check_closure_optimizers(training, self.fabric, plan.precision)
        return new_optimizers, lr_schedule, torch_schedulers

    def _restart_clock(self) -> None:
        """``reset_time``: the clock starts at zero; the epoch in progress (and a checkpoint's position in it) is
        dropped, and the intervals of evaluation and saving start afresh."""
        self.state.timestamp = Timestamp()
        self._epoch.forget()
        self._apply_eval_settings()  # new interval objects
        for saver in _checkpoint_savers(self.state.callbacks):
            saver.interval = restarted_interval(saver.interval)
            saver.last_saved_batch = -1

    def _fit(self) -> None:
        state = self.state
        if state.max_duration is None:
            raise ValueError("fit() needs a duration: pass max_duration= to the Trainer or duration= to fit().")
        if state.dataloader is None:
            raise ValueError("fit() needs a train_dataloader: pass it to the Trainer or to fit().")
        if not state.optimizers:
            self._use_default_optimizer()
        self._apply_grad_accum()
        self._clock_check.start_fit(state, self._named_intervals(), self._train_step.lr_schedule)
        if state.finished and self.fabric.is_global_zero:
            print(
                f"fabric: nothing left to train: the run is at {self._position()}, which max_duration="
                f"{state.max_duration} reaches (a longer max_duration, or fit(duration=...), trains on).",
                file=sys.stderr,
            )
        run_event = self.engine.run_event
        with self._preemption or nullcontext():
            run_event(Event.FIT_START)
            run_event(Event.ITERATION_START)  # one iteration per fit(): there is no iteration length
            while not state.finished:
                if not self._train_epoch():
                    break
            run_event(Event.ITERATION_END)
            run_event(Event.ITERATION_CHECKPOINT)
            run_event(Event.FIT_END)

    def _position(self) -> str:
        """Where training stands, in words: ``epoch 3, batch 24``."""
        timestamp = self.state.timestamp
        return f"epoch {int(timestamp.epoch)}, batch {int(timestamp.batch)}"

    def _use_default_optimizer(self) -> None:
        """A Trainer built without a train dataloader or optimizers trains with Composer's default optimizer."""
        if self.fabric.strategy.engine_handles_gradients:
            raise ValueError(
                "fit() needs optimizers, and DeepSpeed takes the optimizer when its engine is built: pass "
                "optimizers= (or train_dataloader=, for the default DecoupledSGDW) to the Trainer."
            )
        optimizer = default_optimizer(self.state.model)
        warn_default_optimizer(optimizer)
        if optimizer is None:
            raise ValueError("fit() needs optimizers, and the model has no parameters to build the default one from.")
        self.state.optimizers = setup_new_optimizers(self.fabric, self.state.model, optimizer)
        self._train_step.refresh()

    def _apply_grad_accum(self) -> None:
        """``grad_accum=N``: microbatches of the train dataloader's batch size divided by N."""
        grad_accum = self.settings.grad_accum
        if grad_accum is not None and self.state.dataloader is not None:
            self.state.device_train_microbatch_size = microbatch_size_for(grad_accum, self.state.dataloader)

    def _named_intervals(self) -> list[tuple[str, IntervalFunction]]:
        """The intervals of evaluation and saving, named as the user gave them."""
        evaluations = zip(self.evaluators, self._evaluator_intervals, strict=True)
        return [
            *((f"{evaluator.label} eval_interval", interval) for evaluator, interval in evaluations),
            *(("save_interval", saver.interval) for saver in _checkpoint_savers(self.state.callbacks)),
        ]

    def _train_epoch(self) -> bool:
        """Train until the dataloader runs out (True: the epoch ended) or training is finished (False)."""
        state, fire = self.state, self.engine.fire
        assert state.dataloader is not None
        epoch = self._epoch
        # A new epoch, unless fit() continues the epoch an earlier fit() stopped in.
        batches = epoch.begin(state.dataloader) if epoch.batches is None else epoch.batches
        # A loader resumed from its own position may have another share per rank than the batches counted so
        # far suggest (another world size): that epoch ends when the loader does (or at the subset).
        subset = self.settings.train_subset_num_batches
        length = (None if subset == -1 else subset) if epoch.ends_with_loader else state.dataloader_len
        train_step, lr_schedule = self._train_step, self._train_step.lr_schedule
        spec = train_step.data_spec
        prepare = spec.prepare if spec.transforms else None
        while length is None or batches_in_epoch(state.timestamp) < length:
            if lr_schedule is not None:  # the learning rates batch k trains with, seen by all of its events
                lr_schedule.apply(state)
            fire.before_dataloader()
            if epoch.start is None:
                epoch.mark_start(state.dataloader)
            try:
                batch = next(batches)
            except StopIteration:
                break
            state.batch = batch if prepare is None else prepare(batch, self.fabric.to_device)
            fire.after_dataloader()
            train_step.run(state.batch)
            self._after_batch()
            if state.finished and (length is None or batches_in_epoch(state.timestamp) < length):
                return False
            if epoch.batches is None:  # a replica group joined at this batch: a peer's data position arrived
                batches = epoch.begin(state.dataloader)
        if batches_in_epoch(state.timestamp) == 0:
            raise RuntimeError("The train dataloader yielded no batch in this epoch; training cannot progress.")
        if length is not None and length == loader_length(state.dataloader):
            # Run the iterator to its end as a plain ``for`` loop would: samplers draw from their generator
            # there, so the next epoch's shuffle matches a plain PyTorch loop's. An epoch cut short by
            # train_subset_num_batches stops where ``itertools.islice`` would, without fetching another batch.
            next(batches, None)
        epoch.end()
        if not self.step_schedulers_every_batch:
            for scheduler in self._train_step.torch_schedulers:
                scheduler.step()
        state.timestamp = state.timestamp.to_next_epoch()
        self.engine.run_event(Event.EPOCH_END)
        self._evaluate_if_due(Event.EPOCH_END)
        self.engine.run_event(Event.EPOCH_CHECKPOINT)
        return True

    def _after_batch(self) -> None:
        state, fire = self.state, self.engine.fire
        clock_check = self._clock_check
        if clock_check.times_in_tokens:
            clock_check.check_tokens_counted(state.timestamp)
        if state.train_metrics:
            state.metrics.update(compute_metrics(state.train_metrics, "metrics/train", state.train_metric_values))
        if self._reduces_loss:
            loss = self._loss_over_ranks(state.loss)  # a collective: on every rank, whatever each one logs to
            if self.logger.destinations:
                self.logger.log_metrics({"loss/train/total": loss})
        fire.batch_end()
        if self.evaluators:
            self._evaluate_if_due(Event.BATCH_END)
        fire.batch_checkpoint()
        if self._preemption is not None and self._preemption_requested():
            self._stop_for_preemption()

    def _loss_over_ranks(self, loss: Any) -> Any:
        """The batch's loss averaged over the ranks, as Composer logs it (each rank's is of its own shard only); rank
        0 may log where the others do not, so every rank reduces, every batch, as in Composer."""
        if self.fabric.world_size == 1 or not isinstance(loss, torch.Tensor):
            return loss
        return self.fabric.all_reduce(loss.detach(), reduce_op="mean")

    def _stop_for_preemption(self) -> None:
        """SIGTERM arrived: save at this batch boundary, flush, and exit with PREEMPTED_EXIT_CODE."""
        assert self.saver is not None
        path = self.saver.saved[-1] if self.saver.saved and self._saved_this_batch() else self.saver.save(self.state)
        self.saver.wait()
        preempted = TrainingPreempted(path)
        self._report_failure(preempted)  # before close(): trackers end the run KILLED / code 75, not finished
        self.close()
        if self.fabric.is_global_zero:  # SystemExit prints nothing: say why the job ends with 75, once
            print(preempted, file=sys.stderr, flush=True)
        raise preempted

    def _saved_this_batch(self) -> bool:
        assert self.saver is not None
        return self.saver.last_saved_batch == int(self.state.timestamp.batch)

    # --- checkpoints ----------------------------------------------------------------------------

    def save_checkpoint(self, path: str, weights_only: bool = False) -> None:
        """Save the whole Trainer (or only the model) to ``path``, a local path or fsspec URL. Call on every rank."""
        self.checkpointer.save(path, weights_only)

    def load_checkpoint(
        self, path: str, *, weights_only: bool = False, strict: bool = True, ignore_keys: Sequence[str] = ()
    ) -> None:
        """Restore the Trainer from ``path``; a checkpoint that cannot be loaded changes nothing.

        ``ignore_keys`` skips parts: ``"optimizers"``, ``"rng"``, ``"timestamp"``, ``"schedulers"``,
        ``"algorithms"``, ``"callbacks"``, ``"dataloader"``, ``"microbatch_size"``, ``"model"`` and the metrics
        (e.g. to fine-tune), also by Composer's paths (``"state/optimizers"``, ``"rng"``; see
        :mod:`fabric.trainer.checkpoint.parts`). Parts the checkpoint was saved without are skipped too.
        """
        self.engine.run_event(Event.BEFORE_LOAD)
        self.checkpointer.load(path, weights_only=weights_only, strict=strict, ignore_keys=ignore_keys)
        self.engine.run_event(Event.AFTER_LOAD)

    def _evaluate_if_due(self, event: Event) -> None:
        if not self.evaluators:
            return
        due = [
            evaluator
            for evaluator, interval in zip(self.evaluators, self._evaluator_intervals, strict=True)
            if interval(self.state, event)
        ]
        if not due:
            return
        stop_requested = self._preemption_requested if self._may_stop_evaluation_early(due) else None
        try:
            run_evaluators(self.state, self.engine, self.logger, due, stop_requested=stop_requested)
        except EvaluationInterrupted:  # preempted mid-round: save the training state now, not after the round
            self._stop_for_preemption()

    def _may_stop_evaluation_early(self, evaluators: list[Evaluator]) -> bool:
        """Whether a preemption may stop this round between batches: the check is a collective, so only when every
        rank runs the same known number of batches (one all-gather of the counts tells). Otherwise the round runs
        to its end, and the job saves after it."""
        if self._preemption is None:
            return False
        counts = [batches_in(evaluator, batch_limit(evaluator)) for evaluator in evaluators]
        if self.fabric.world_size == 1:
            return True
        known = torch.tensor([-1 if count is None else count for count in counts], device=self.fabric.device)
        gathered = self.fabric.all_gather(known)
        return bool((known >= 0).all() and (gathered == known).all())

    def _preemption_requested(self) -> bool:
        """Whether any rank received SIGTERM (a collective: every rank asks at the same point)."""
        return self._preemption is not None and self._preemption.requested_anywhere(self.fabric)

    # --- evaluation and prediction ----------------------------------------------------------------

    def eval(self, eval_dataloader: Any = None, subset_num_batches: int | None = -1) -> dict[str, float]:
        """Run every evaluator once between EVAL_STANDALONE_START and EVAL_STANDALONE_END; returns the computed
        metrics. As in Composer: ``eval_dataloader`` (a dataloader, an Evaluator, or a list or dict of them) is
        evaluated instead, this once (the Trainer's evaluators stay those of ``fit``); ``subset_num_batches`` other
        than -1 (or ``None``) limits every evaluator this once, else each runs its own (an evaluator given here
        without one: all its batches)."""
        subset = -1 if subset_num_batches is None else subset_num_batches
        check_subset_num_batches(subset, "subset_num_batches")
        if eval_dataloader is None:
            evaluators = self.evaluators
        else:
            evaluators = plan_evaluators(eval_dataloader, self.fabric)
            self._prepare_evaluators(evaluators)
        if not evaluators:
            raise ValueError("eval() needs an eval_dataloader: pass it to the Trainer or to eval().")
        with self._failures_logged():
            run_evaluators(self.state, self.engine, self.logger, evaluators, standalone=True, subset_num_batches=subset)
        labels = tuple(f"metrics/{evaluator.label}/" for evaluator in evaluators)
        return {name: value for name, value in self.state.metrics.items() if name.startswith(labels)}

    def predict(
        self, dataloader: Iterable[Any] | DataSpec, *, return_outputs: bool = True, subset_num_batches: int = -1
    ) -> list[Any]:
        """The model's outputs for every batch of ``dataloader`` (on the CPU), or ``[]`` to only stream them."""
        spec = ensure_data_spec(dataloader)
        return run_prediction(
            self.state,
            self.engine,
            self._setup_dataloader(spec),
            spec,
            return_outputs=return_outputs,
            subset_num_batches=subset_num_batches,
        )

    @contextmanager
    def _failures_logged(self) -> Iterator[None]:
        """An exception ending ``fit()``/``eval()`` reaches the loggers before it propagates."""
        try:
            yield
        except BaseException as error:
            if error is not self._reported_failure:
                self._report_failure(error)
            raise

    def _report_failure(self, error: BaseException) -> None:
        """Tell the loggers how the run ends (``log_exception``), once per error."""
        self._reported_failure = error
        self.logger.log_exception(error)

    def export_for_inference(
        self,
        save_format: str,
        save_path: str,
        save_object_store: object = None,
        sample_input: Any = None,
        transforms: Sequence[Callable[[nn.Module], nn.Module]] | None = None,
        input_names: Sequence[str] | None = None,
        output_names: Sequence[str] | None = None,
    ) -> None:
        """Composer's ``Trainer.export_for_inference``: rank 0 exports the model as it is now to the local file
        ``save_path`` (see :func:`fabric.trainer.export.export_for_inference`); every rank returns once it is written.
        ``sample_input`` is one batch as the model's ``forward`` takes it."""
        if self.fabric.is_global_zero:
            export_for_inference(
                user_model(self.state), save_format, save_path, save_object_store=save_object_store,
                sample_input=sample_input, transforms=transforms, input_names=input_names, output_names=output_names,
            )  # fmt: skip
        self.fabric.barrier("export_for_inference")

    def close(self) -> None:
        """Every callback's ``close(state, logger)`` (savers wait for their uploads), then the loggers' (flush,
        close files), then every ``post_close()``, as in Composer. Safe to call twice: the second call does nothing."""
        if not self._closed:
            self._closed = True
            self.engine.close()


# --- helpers ------------------------------------------------------------------------------------


def _launch(fabric: Fabric) -> None:
    """Start the other local ranks when the strategy re-runs the script; spawn/fork strategies need a function."""
    strategy = fabric.strategy
    if strategy.launch_needs_function and strategy.needs_launch and not fabric.launched:
        raise ValueError(
            f"strategy={strategy!r} runs a function per process: "
            "build the Trainer inside fabric.launch(fn), or use strategy='ddp'."
        )
    fabric.launch()


def _join_processes(fabric: Fabric, seed: int | None, run_name: str | None) -> tuple[int, str]:
    """Start (or join) the other ranks, then agree with them on the seed (seeding every rank) and the run name."""
    _launch(fabric)
    agreed_seed = _agree_on_seed(fabric, seed)
    fabric.seed_everything(agreed_seed)
    return agreed_seed, _agree_on_run_name(fabric, run_name)


def _agree_on_seed(fabric: Fabric, seed: int | None) -> int:
    """The given seed, else one drawn on rank 0 and shared, so every rank shuffles identically."""
    if seed is not None:
        return seed
    drawn = random.SystemRandom().randrange(2**31)
    return int(fabric.broadcast(drawn, src=0)) if fabric.world_size > 1 else drawn


def _agree_on_run_name(fabric: Fabric, run_name: str | None) -> str:
    """The given name, else ``run-<UTC time>-<6 hex digits>`` made on rank 0 and shared with every rank."""
    if run_name is not None:  # checked by the plan
        return run_name
    made = f"run-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{random.SystemRandom().getrandbits(24):06x}"
    return str(fabric.broadcast(made, src=0)) if fabric.world_size > 1 else made


def _start_engine(
    state: State, fabric: Fabric, loggers: Sequence[Any], progress_bar: bool, passes: Sequence[AlgorithmPass]
) -> tuple[Logger, Engine]:
    """The logger facade and the engine that fires the events (algorithms ordered by ``passes``), after firing INIT
    (before the model is set up, so model surgery happens on the plain model)."""
    logger = connect_loggers(state, fabric, loggers, progress_bar)
    destinations = logger.destinations
    engine = Engine(state, logger, state.algorithms, state.callbacks, loggers=destinations, passes=passes)
    engine.run_event(Event.INIT)
    return logger, engine


def _setup_model(
    fabric: Fabric, module: nn.Module, optimizers: list[Optimizer], compile_options: Mapping[str, Any] | None
) -> tuple[nn.Module, list[Optimizer]]:
    """The model (with ``loss``: :func:`~fabric.trainer.plan.check_trainer_model`) and its optimizers set up on
    ``fabric`` (compiled with ``compile_options``, unless None)."""
    if optimizers:
        model, *set_up = fabric.setup(module, *optimizers, compile=compile_options)
    else:  # eval or predict only: setup() then returns the module alone
        model, set_up = fabric.setup(module, compile=compile_options), []
    if callable(getattr(module, "eval_forward", None)):
        model.mark_forward_method("eval_forward")
    return model, set_up


def _pipeline_loss(strategy: Strategy, state: State) -> PipelineLoss | None:
    """Under pipeline stages, the loss the last stage computes from the model's ``loss``, given to the strategy's
    plan before the model is set up (see :mod:`fabric.trainer.pipeline`); None otherwise."""
    if strategy.pipeline is None or not hasattr(state.model, "loss"):  # a model without loss is refused by the plan
        return None
    model = state.model
    loss: Callable[[Any, Any], Any] = model.loss  # type: ignore[assignment]  # the Trainer's models have one
    pipeline = PipelineLoss(lambda outputs, batch: pipelined_loss(loss(outputs, batch), len(state.optimizers)))
    strategy.pipeline = pipeline.plan(strategy.pipeline, model)
    return pipeline


def _all_schedulers(lr_schedule: LRSchedule | None, torch_schedulers: Sequence[LRScheduler]) -> list[Any]:
    """What ``state.schedulers`` holds: the schedule of Composer's schedulers first, then the PyTorch ones."""
    return [*([lr_schedule] if lr_schedule else []), *torch_schedulers]


def _steps_every_batch(given: bool | None, torch_schedulers: Sequence[LRScheduler]) -> bool:
    """Whether the PyTorch schedulers step every batch (else every epoch): as given, else Composer's default (every
    epoch when a PyTorch scheduler is among them, as its ``LinearLR(total_iters=5)`` counts epochs; Composer's own
    schedules always follow the clock every batch)."""
    return given if given is not None else not torch_schedulers


def _checkpoint_savers(callbacks: Iterable[Any]) -> list[CheckpointSaver]:
    """The CheckpointSaver callbacks: the one the ``save_*`` options build and any passed in ``callbacks``."""
    return [callback for callback in callbacks if isinstance(callback, CheckpointSaver)]


def _setup_checkpointing(
    state: State,
    run_name: str,
    storage_options: StorageOptions,
    save_ignore_keys: Sequence[str],
    save_metrics: bool,
    *,
    data_position: Callable[[], DataPosition],
    on_load_position: Callable[[DataPosition], None],
) -> tuple[SelectiveCheckpointer, CheckpointSaver | None]:
    """The checkpointer, bound to every CheckpointSaver; and the first saver (None: there is none), the one a
    preemption saves with. ``data_position`` and ``on_load_position`` save and restore the place in the epoch."""
    trainer_state = TrainerCheckpointState(
        state, state.schedulers, state.callbacks, data_position=data_position, on_load_position=on_load_position
    )
    checkpointer = SelectiveCheckpointer(
        state, trainer_state, run_name, storage_options, save_ignore_keys=save_ignore_keys, save_metrics=save_metrics
    )
    savers = _checkpoint_savers(state.callbacks)
    for saver in savers:
        saver.bind(checkpointer.save, run_name, require_fabric(state).strategy.replica_group)
    return checkpointer, savers[0] if savers else None


def _share_with_joining_replicas(
    fabric: Fabric,
    state: State,
    data_position: Callable[[], DataPosition],
    on_load_position: Callable[[DataPosition], None],
) -> None:
    """The Trainer's clock, schedulers, callbacks and data position go to a replica group that joins the run (with
    fault tolerance; other strategies have none), beside the weights and optimizer state the strategy sends."""
    trainer_state = TrainerCheckpointState(
        state, state.schedulers, state.callbacks, data_position=data_position, on_load_position=on_load_position
    )
    fabric.strategy.share_with_joining_replicas("trainer", trainer_state.load_state_dict, trainer_state.state_dict)


def _initial_state(plan: TrainerPlan, fabric: Fabric, run_name: str) -> State:
    """The run's state before set-up: the plain model and optimizers, the callbacks (with the saver and profiler)."""
    callbacks = [*plan.callbacks, *([CheckpointSaver.from_settings(plan.save)] if plan.save else [])]
    if plan.profiler is not None:
        plan.profiler.bind(run_name)  # its trace folder is named after the run
        callbacks.append(plan.profiler)
    return State(
        model=plan.model,
        optimizers=list(plan.optimizers),
        algorithms=list(plan.algorithms),
        callbacks=callbacks,
        fabric=fabric,
        run_name=run_name,
        max_duration=plan.max_duration,
    )
