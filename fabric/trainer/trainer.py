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
from fabric.trainer.callbacks._utils import user_model
from fabric.trainer.checkpoint.checkpointer import find_resume_checkpoint, read_surgery_records
from fabric.trainer.checkpoint.dataloader_position import (
    EpochStart,
    capture_epoch_start,
    capture_loader_state,
    epoch_start_record,
    keeps_own_position,
    resume_iterator,
)
from fabric.trainer.checkpoint.parts import SelectiveCheckpointer, check_ignore_paths, load_parts
from fabric.trainer.checkpoint.preemption import PreemptionWatch, TrainingPreempted
from fabric.trainer.checkpoint.sample_position import (
    EpochPlan,
    check_resumable,
    count_untrained,
    layout_change,
    planned_epoch,
    resumed_plan,
    samples_record,
)
from fabric.trainer.checkpoint.saver import CheckpointSaver
from fabric.trainer.checkpoint.trainer_state import DataPosition, TrainerCheckpointState
from fabric.trainer.clock_check import ClockCheck
from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.callback import Callback
from fabric.trainer.core.engine import Engine
from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.passes import AlgorithmPass
from fabric.trainer.core.state import State, loader_length
from fabric.trainer.core.time import Time, Timestamp, TimeUnit
from fabric.trainer.data_spec import DataSpec, ensure_data_spec
from fabric.trainer.evaluation import (
    EvaluationInterrupted,
    Evaluator,
    batches_in,
    ensure_evaluators,
    run_evaluators,
    select_metrics,
)
from fabric.trainer.export import export_for_inference
from fabric.trainer.intervals import IntervalFunction, IntervalInput, create_eval_interval
from fabric.trainer.loggers.wiring import LoggerInput, connect_loggers
from fabric.trainer.metrics import compute_metrics, model_metrics
from fabric.trainer.migration import algorithm_passes as merged_passes
from fabric.trainer.migration import (
    apply_dist_timeout,
    check_compile_config,
    check_exclude_algorithms,
    check_flag,
    check_grad_accum,
    check_spin_dataloaders,
    check_subset_num_batches,
    console_loggers,
    enable_deterministic_mode,
    load_path_from,
    microbatch_size_for,
    strict_model_weights,
    take_composer_arguments,
    translate_fabric_choices,
    without_excluded,
)
from fabric.trainer.prediction import run_prediction
from fabric.trainer.profiler import Profiler
from fabric.trainer.schedulers import LRSchedule
from fabric.trainer.stages import (
    check_schedulers_follow,
    default_optimizer,
    precision_for_fit,
    rebound_schedule,
    restarted_interval,
    setup_new_optimizers,
    switch_precision,
    warn_default_optimizer,
)
from fabric.trainer.surgery import reapply_surgery
from fabric.trainer.train_step import TokenCounter, TrainStep, check_closure_optimizers, count_tokens
from fabric.utilities.apply_func import as_list
from fabric.utilities.cli_contract import FABRIC_CHOICES
from fabric.utilities.rank_zero import rank_zero_warn


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
        take_composer_arguments(fabric_choices)
        enable_deterministic_mode(deterministic_mode)  # before anything runs a kernel, as in Composer
        self.train_subset_num_batches = check_subset_num_batches(train_subset_num_batches, "train_subset_num_batches")
        given_loader = None if train_dataloader is None else ensure_data_spec(train_dataloader).dataloader
        check_spin_dataloaders(spin_dataloaders, given_loader, keeps_own_position)
        self.spin_dataloaders = spin_dataloaders
        check_subset_num_batches(eval_subset_num_batches, "eval_subset_num_batches")
        passes = merged_passes(algorithm_passes)
        loggers = console_loggers(log_to_console, console_log_interval, console_stream, as_list(loggers), progress_bar)
        load_strict = strict_model_weights(load_strict, load_strict_model_weights)
        save_ignore_keys = check_ignore_paths(save_ignore_keys, "save_ignore_keys")
        check_flag(save_metrics, "save_metrics")
        load_ignore_keys = check_ignore_paths(load_ignore_keys, "load_ignore_keys")
        load_parts(load_ignore_keys)
        excluded_algorithms = check_exclude_algorithms(load_exclude_algorithms)
        compile_options = check_compile_config(compile_config, model)
        if parallelism_config is not None and fabric is not None:
            raise ValueError(
                "Pass either fabric= or parallelism_config=, not both: that Fabric already has its strategy."
            )
        saver = _make_saver(
            autoresume,
            run_name,
            save_folder,
            filename=save_filename,
            latest_filename=save_latest_filename,
            save_interval=save_interval,
            num_checkpoints_to_keep=save_num_checkpoints_to_keep,
            weights_only=save_weights_only,
            overwrite=save_overwrite,
            storage_options=storage_options,
            async_save=save_async,
        )
        self.storage_options = storage_options
        choices = translate_fabric_choices(fabric_choices, device, deepspeed_config, parallelism_config, model)
        self.fabric = _make_fabric(fabric, choices)
        apply_dist_timeout(self.fabric, dist_timeout, fabric_given=fabric is not None)
        load_path = load_path_from(load_path, load_path_format)
        microbatch_size = check_grad_accum(grad_accum, device_train_microbatch_size)
        _check_microbatch_size(microbatch_size, self.fabric)
        _check_ratio(scale_schedule_ratio)
        self._grad_accum = grad_accum if isinstance(grad_accum, int) else None  # resolved per train dataloader
        self.scale_schedule_ratio = float(scale_schedule_ratio)
        self.seed, self.run_name = _join_processes(self.fabric, seed, run_name)
        defaulted = optimizers is None and (train_dataloader is not None or bool(as_list(schedulers)))
        if defaulted:
            optimizers = default = default_optimizer(model)  # Composer's default, for a Trainer that is to train
        self.state = state = State(
            model=model,
            optimizers=as_list(optimizers),
            algorithms=as_list(algorithms),
            callbacks=[*as_list(callbacks), *([saver] if saver else []), *_bound_profiler(profiler, self.run_name)],
            fabric=self.fabric,
            run_name=self.run_name,
            max_duration=None if max_duration is None else _scaled_duration(max_duration, self.scale_schedule_ratio),
        )
        self.logger, self.engine = _start_engine(state, self.fabric, loggers, progress_bar, passes)
        found: str | None = None  # autoresume's checkpoint
        if autoresume:  # the newest checkpoint of this run wins over load_path (which starts a run)
            assert save_folder is not None
            found = _find_resume_checkpoint(
                self.fabric, self.run_name, save_folder, save_filename, save_latest_filename, storage_options
            )
            if found is not None:
                load_path, load_weights_only, load_ignore_keys = found, False, ()
        if load_path is not None:  # surgery the checkpoint was saved with, and this run does not do itself
            surgery = without_excluded(read_surgery_records(load_path, storage_options), excluded_algorithms)
            reapply_surgery(state.model, surgery, state.optimizers, state.algorithms)
        state.model, state.optimizers = _setup_model(self.fabric, state.model, state.optimizers, compile_options)
        lr_schedule, torch_schedulers = self._setup_schedulers(
            as_list(schedulers), state.optimizers, self.scale_schedule_ratio
        )
        state.schedulers = _all_schedulers(lr_schedule, torch_schedulers)
        state.train_metrics = model_metrics(state.model.module, True, self.fabric)
        self._scheduler_stepping_given = step_schedulers_every_batch
        self._train_step = TrainStep(
            state,
            self.engine,
            lr_schedule=lr_schedule,
            torch_schedulers=torch_schedulers,
            step_schedulers_every_batch=_steps_every_batch(step_schedulers_every_batch, torch_schedulers),
            microbatch_size=microbatch_size,
            token_counter=_token_counter(get_num_tokens_in_batch, model),
            accumulate_on_tokens=check_flag(accumulate_train_batch_on_tokens, "accumulate_train_batch_on_tokens"),
        )
        self._clock_check = ClockCheck()
        self._forget_epoch()
        if train_dataloader is not None:
            self._set_train_dataloader(train_dataloader)
        create_eval_interval(eval_interval)  # bad input fails here; each evaluator gets its own
        self.eval_interval, self.eval_subset_num_batches = eval_interval, eval_subset_num_batches
        self._set_evaluators(eval_dataloader)
        self._apply_grad_accum()
        self._closed = False
        self._reported_failure: BaseException | None = None
        self.checkpointer, self.saver = _setup_checkpointing(
            state,
            self.run_name,
            storage_options,
            save_ignore_keys,
            save_metrics,
            data_position=self._data_position,
            on_load_position=self._set_resume_position,
        )
        _share_with_joining_replicas(self.fabric, state, self._position_after_this_batch, self._set_resume_position)
        self._preemption = PreemptionWatch() if self.saver is not None else None
        if load_path is not None:
            self.load_checkpoint(
                load_path, weights_only=load_weights_only, strict=load_strict, ignore_keys=load_ignore_keys
            )
        else:  # as in Composer, the load events fire in every set-up, also when nothing loads
            self.engine.run_event(Event.BEFORE_LOAD)
            self.engine.run_event(Event.AFTER_LOAD)
        if defaulted:  # said only once every argument proved valid: never before a configuration error
            warn_default_optimizer(default)
        if found is not None and self.fabric.is_global_zero:
            print(
                f"fabric: autoresume: resumed run {self.run_name!r} from {found} at {self._position()}.",
                file=sys.stderr,
            )

    @property
    def step_schedulers_every_batch(self) -> bool:
        """Whether the PyTorch schedulers step every batch (else every epoch): see :func:`_steps_every_batch`."""
        return self._train_step.step_schedulers_every_batch

    # --- set-up parts, also used after __init__ ---------------------------------------------------

    def _forget_epoch(self) -> None:
        """No epoch in progress: the next fit() starts one afresh, where the clock is (or a loaded checkpoint was)."""
        self._batches: Iterator[Any] | None = None  # the current epoch's, kept when fit() ends mid-epoch
        self._epoch_ends_with_loader = False
        self._epoch_start: EpochStart | dict[str, Any] | None = None  # what rebuilds the current epoch's batch order
        self._resume_position: DataPosition | None = None
        #: The plan of an epoch resumed by samples, and the batches of the epoch counted before it began.
        self._epoch_plan: tuple[EpochPlan, int] | None = None

    @staticmethod
    def _setup_schedulers(
        schedulers: list[Any], optimizers: list[Optimizer], scale_schedule_ratio: float
    ) -> tuple[LRSchedule | None, list[LRScheduler]]:
        torch_schedulers = [scheduler for scheduler in schedulers if isinstance(scheduler, LRScheduler)]
        ours = [scheduler for scheduler in schedulers if not isinstance(scheduler, LRScheduler)]
        if not ours:
            return None, torch_schedulers
        if not optimizers:
            raise ValueError(f"schedulers={ours} need optimizers to schedule; pass optimizers=... as well.")
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
            self._scheduler_stepping_given, train_step.torch_schedulers
        )

    def _set_train_dataloader(self, dataloader: Iterable[Any] | DataSpec) -> None:
        spec = ensure_data_spec(dataloader)
        check_spin_dataloaders(self.spin_dataloaders, spec.dataloader, keeps_own_position)
        self._train_step.data_spec = spec
        loader = self._setup_dataloader(spec)
        self.state.dataloader = loader
        self._batches = None
        self.state.dataloader_len = self._epoch_length(loader)

    def _epoch_length(self, loader: Iterable[Any]) -> int | None:
        """Batches per epoch: the loader's length, or ``train_subset_num_batches`` when that is fewer (or the loader
        has none)."""
        length = loader_length(loader)
        subset = self.train_subset_num_batches
        if subset == -1:
            return length
        return subset if length is None else min(length, subset)

    def _set_evaluators(self, eval_dataloader: Any) -> None:
        evaluators = ensure_evaluators(eval_dataloader)
        # Each evaluator's own subset (None: the Trainer's), so that fit(eval_subset_num_batches=) changes the rest.
        self._own_eval_subsets = [
            None if evaluator.subset_num_batches == -1 else evaluator.subset_num_batches for evaluator in evaluators
        ]
        for evaluator in evaluators:
            _check_microbatch_size(evaluator.device_eval_microbatch_size, self.fabric, "device_eval_microbatch_size")
            evaluator.dataloader = self._setup_dataloader(evaluator.data_spec)
            eval_metrics = model_metrics(self.state.model.module, False, self.fabric)  # each evaluator its own
            self.state.eval_metrics[evaluator.label] = select_metrics(eval_metrics, evaluator)
        self.evaluators = evaluators
        self._apply_eval_settings()

    def _apply_eval_settings(self) -> None:
        """The Trainer's ``eval_subset_num_batches`` and ``eval_interval`` for the evaluators without their own."""
        for evaluator, own in zip(self.evaluators, self._own_eval_subsets, strict=True):
            evaluator.subset_num_batches = self.eval_subset_num_batches if own is None else own
        evaluators = self.evaluators
        # One interval per evaluator: an interval fires once per batch, so a shared one would run only the first.
        self._evaluator_intervals = [
            create_eval_interval(self.eval_interval)
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
        take_composer_arguments({"train_dataloader_label": train_dataloader_label})
        with self._failures_logged():
            self._start_stage(
                train_dataloader=train_dataloader,
                train_subset_num_batches=train_subset_num_batches,
                spin_dataloaders=spin_dataloaders,
                duration=duration,
                reset_time=reset_time,
                schedulers=schedulers,
                scale_schedule_ratio=scale_schedule_ratio,
                step_schedulers_every_batch=step_schedulers_every_batch,
                eval_dataloader=eval_dataloader,
                eval_subset_num_batches=eval_subset_num_batches,
                eval_interval=eval_interval,
                optimizers=optimizers,
                precision=precision,
                device_train_microbatch_size=device_train_microbatch_size,
            )
            self._fit()

    def _start_stage(
        self,
        *,
        train_dataloader: Iterable[Any] | DataSpec | None,
        train_subset_num_batches: int | None,
        spin_dataloaders: bool | None,
        duration: Time[Any] | str | int | None,
        reset_time: bool,
        schedulers: Any,
        scale_schedule_ratio: float,
        step_schedulers_every_batch: bool | None,
        eval_dataloader: Any,
        eval_subset_num_batches: int | None,
        eval_interval: IntervalInput | None,
        optimizers: Optimizer | Sequence[Optimizer] | None,
        precision: str | None,
        device_train_microbatch_size: int | str | None,
    ) -> None:
        """Apply ``fit()``'s arguments (see :meth:`fit`): all are checked, and the new objects set up, first."""
        state = self.state
        # 1. Check the values.
        if not isinstance(reset_time, bool):
            raise ValueError(f"fit(reset_time={reset_time!r}) is not valid. Accepted: True or False.")
        new_data = None if train_dataloader is None else ensure_data_spec(train_dataloader)
        spin = self.spin_dataloaders if spin_dataloaders is None else spin_dataloaders
        check_spin_dataloaders(spin, state.dataloader if new_data is None else new_data.dataloader, keeps_own_position)
        if train_subset_num_batches is not None:
            check_subset_num_batches(train_subset_num_batches, "train_subset_num_batches")
        extra = None if duration is None else _positive_time(duration, "duration")
        _check_ratio(scale_schedule_ratio)
        if scale_schedule_ratio != 1.0 and schedulers is None:
            raise ValueError(
                f"fit(scale_schedule_ratio={scale_schedule_ratio}) scales the schedulers given with it (and "
                "max_duration); pass schedulers= too, as in Composer."
            )
        if step_schedulers_every_batch is not None and not isinstance(step_schedulers_every_batch, bool):
            raise ValueError(f"step_schedulers_every_batch={step_schedulers_every_batch!r} must be True or False.")
        if eval_subset_num_batches is not None:
            check_subset_num_batches(eval_subset_num_batches, "eval_subset_num_batches")
        if eval_interval is not None:
            create_eval_interval(eval_interval)
        if (eval_interval is not None or eval_subset_num_batches is not None) and not (
            eval_dataloader is not None or self.evaluators
        ):
            raise ValueError(
                "fit(eval_interval=/eval_subset_num_batches=) set how to evaluate, but there is no eval_dataloader: "
                "pass eval_dataloader= as well."
            )
        if device_train_microbatch_size is not None:
            _check_microbatch_size(device_train_microbatch_size, self.fabric)
        new_precision = None if precision is None else precision_for_fit(self.fabric, precision)
        # 2. Set up the new objects (nothing of the Trainer changes yet).
        new_optimizers = None if optimizers is None else setup_new_optimizers(self.fabric, state.model, optimizers)
        training = state.optimizers if new_optimizers is None else new_optimizers
        lr_schedule, torch_schedulers = self._train_step.lr_schedule, list(self._train_step.torch_schedulers)
        if schedulers is not None:
            lr_schedule, torch_schedulers = self._setup_schedulers(as_list(schedulers), training, scale_schedule_ratio)
        elif new_optimizers is not None:
            lr_schedule = rebound_schedule(lr_schedule, new_optimizers)
        if new_optimizers is not None:
            check_schedulers_follow(torch_schedulers, new_optimizers)
        if new_optimizers is not None or new_precision is not None:
            check_closure_optimizers(training, self.fabric, new_precision)
        # 3. Change the Trainer: first the train dataloader, whose set-up may still fail.
        if spin_dataloaders is not None:
            self.spin_dataloaders = spin_dataloaders
        if train_subset_num_batches is not None:
            self.train_subset_num_batches = train_subset_num_batches
        if new_data is not None:
            self._set_train_dataloader(new_data)
        elif train_subset_num_batches is not None and state.dataloader is not None:
            state.dataloader_len = self._epoch_length(state.dataloader)
        if reset_time:
            self._restart_clock()
        if extra is not None:
            state.max_duration = Time(int(state.timestamp.get(extra.unit)) + int(extra.value), extra.unit)
        if scale_schedule_ratio != 1.0 and state.max_duration is not None:
            state.max_duration = _scaled(state.max_duration, scale_schedule_ratio)
        if new_optimizers is not None:
            state.optimizers = new_optimizers
        if schedulers is not None or new_optimizers is not None:
            self._install_schedulers(lr_schedule, torch_schedulers)
        if step_schedulers_every_batch is not None:
            self._scheduler_stepping_given = step_schedulers_every_batch
            self._set_scheduler_stepping()
        self._start_evaluation_stage(eval_dataloader, eval_subset_num_batches, eval_interval)
        if device_train_microbatch_size is not None:
            self._grad_accum = None  # an explicit microbatch size replaces grad_accum's
            self._train_step.set_microbatch_size(device_train_microbatch_size)
        if new_precision is not None:
            switch_precision(self.fabric, new_precision)
        if new_optimizers is not None or new_precision is not None:
            self._train_step.refresh()

    def _start_evaluation_stage(
        self, eval_dataloader: Any, subset_num_batches: int | None, eval_interval: IntervalInput | None
    ) -> None:
        if subset_num_batches is not None:
            self.eval_subset_num_batches = subset_num_batches
        if eval_interval is not None:
            self.eval_interval = eval_interval
        if eval_dataloader is not None:
            self._set_evaluators(eval_dataloader)
        elif subset_num_batches is not None or eval_interval is not None:
            self._apply_eval_settings()

    def _restart_clock(self) -> None:
        """``reset_time``: the clock starts at zero; the epoch in progress (and a checkpoint's position in it) is
        dropped, and the intervals of evaluation and saving start afresh."""
        self.state.timestamp = Timestamp()
        self._forget_epoch()
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
        if self._grad_accum is not None and self.state.dataloader is not None:
            self.state.device_train_microbatch_size = microbatch_size_for(self._grad_accum, self.state.dataloader)

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
        if self._batches is None:  # a new epoch; otherwise fit() continues the epoch an earlier fit() stopped in
            self._batches = self._start_epoch(state.dataloader)
        batches = self._batches
        # A loader resumed from its own position may have another share per rank than the batches counted so
        # far suggest (another world size): that epoch ends when the loader does (or at the subset).
        subset = self.train_subset_num_batches
        length = (None if subset == -1 else subset) if self._epoch_ends_with_loader else state.dataloader_len
        train_step, lr_schedule = self._train_step, self._train_step.lr_schedule
        spec = train_step.data_spec
        prepare = spec.prepare if spec.transforms else None
        while length is None or int(state.timestamp.batch_in_epoch) < length:
            if lr_schedule is not None:  # the learning rates batch k trains with, seen by all of its events
                lr_schedule.apply(state)
            fire.before_dataloader()
            if self._epoch_start is None:
                self._epoch_start = EpochStart.take(state.dataloader)
            try:
                batch = next(batches)
            except StopIteration:
                break
            state.batch = batch if prepare is None else prepare(batch, self.fabric.to_device)
            fire.after_dataloader()
            train_step.run(state.batch)
            self._after_batch()
            if state.finished and (length is None or int(state.timestamp.batch_in_epoch) < length):
                return False
            if self._batches is None:  # a replica group joined at this batch: a peer's data position arrived
                batches = self._batches = self._start_epoch(state.dataloader)
        if int(state.timestamp.batch_in_epoch) == 0:
            raise RuntimeError("The train dataloader yielded no batch in this epoch; training cannot progress.")
        if length is not None and length == loader_length(state.dataloader):
            # Run the iterator to its end as a plain ``for`` loop would: samplers draw from their generator
            # there, so the next epoch's shuffle matches a plain PyTorch loop's. An epoch cut short by
            # train_subset_num_batches stops where ``itertools.islice`` would, without fetching another batch.
            next(batches, None)
        self._batches = None
        self._epoch_ends_with_loader = False
        self._epoch_plan = None
        if not self.step_schedulers_every_batch:
            for scheduler in self._train_step.torch_schedulers:
                scheduler.step()
        state.timestamp = state.timestamp.to_next_epoch()
        self.engine.run_event(Event.EPOCH_END)
        self._evaluate_if_due(Event.EPOCH_END)
        self.engine.run_event(Event.EPOCH_CHECKPOINT)
        return True

    def _start_epoch(self, dataloader: Iterable[Any]) -> Iterator[Any]:
        """The epoch's batch iterator: fresh (after EPOCH_START), or positioned where a checkpoint left off."""
        position, self._resume_position = self._resume_position, None
        if position is not None and position.loader_state is not None and keeps_own_position(dataloader):
            dataloader.load_state_dict(position.loader_state)  # type: ignore[attr-defined]
            if position.batches_done == 0:
                self.engine.run_event(Event.EPOCH_START)
            self._epoch_start = None
            self._epoch_ends_with_loader = position.batches_done > 0
            return iter(dataloader)  # the loader continues where it was, on any number of ranks
        if position is not None and position.epoch_start is not None:
            if position.batches_done and layout_change(position, dataloader, self.fabric.world_size):
                return self._resume_by_samples(dataloader, position)
            same_world = position.world_size == self.fabric.world_size
            # At an epoch boundary with another world size the loader is sharded differently: start it afresh.
            self._epoch_start = position.epoch_start if same_world else capture_epoch_start(dataloader)
            if position.batches_done == 0:
                self.engine.run_event(Event.EPOCH_START)
            return resume_iterator(dataloader, self._epoch_start, position.batches_done)
        self.engine.run_event(Event.EPOCH_START)
        self._epoch_start = None  # captured right before the first fetch, after any BEFORE_DATALOADER draws
        return iter(dataloader)

    def _resume_by_samples(self, dataloader: Iterable[Any], position: DataPosition) -> Iterator[Any]:
        """The rest of an epoch saved with another world size or batch size: the samples it had not trained yet,
        dealt to this run's ranks (:mod:`~fabric.trainer.checkpoint.sample_position`)."""
        assert position.samples is not None and position.epoch_start is not None  # checked when it was loaded
        rank_zero_warn(
            f"Resuming mid-epoch with {layout_change(position, dataloader, self.fabric.world_size)}: the "
            f"{count_untrained(position.samples)} samples of the epoch not trained yet are dealt to this run's "
            "ranks, each once; their order and the random numbers differ from an uninterrupted run's."
        )
        plan = resumed_plan(position.samples, dataloader, self.fabric.world_size)
        self._epoch_plan = (plan, position.batches_done)
        self._epoch_start = position.epoch_start
        self._epoch_ends_with_loader = True
        return planned_epoch(dataloader, plan.batches_of(self.fabric.global_rank), position.epoch_start)

    def _data_position(self) -> DataPosition:
        timestamp, loader = self.state.timestamp, self.state.dataloader
        batches_done = int(timestamp.batch_in_epoch)
        epoch_start = self._epoch_start if batches_done else (capture_epoch_start(loader) if loader else None)
        epoch_start = None if epoch_start is None else epoch_start_record(epoch_start)
        loader_state = capture_loader_state(loader) if keeps_own_position(loader) else None
        samples = None
        if batches_done and loader_state is None and loader is not None:
            samples = samples_record(loader, self.fabric.world_size, batches_done, self._epoch_plan)
        samples_done = int(timestamp.sample_in_epoch)
        return DataPosition(epoch_start, batches_done, samples_done, self.fabric.world_size, loader_state, samples)

    def _position_after_this_batch(self) -> DataPosition:
        """Where the data stands once the batch in flight is trained: what a replica group joining the run at this
        step continues its own share from (fault tolerance; asked for during the step)."""
        timestamp, loader = self.state.timestamp, self.state.dataloader
        if self._epoch_start is None or loader is None:
            raise RuntimeError("A replica group asked for the data position outside a training step.")
        loader_state = capture_loader_state(loader) if keeps_own_position(loader) else None
        batches_done, samples_done = int(timestamp.batch_in_epoch) + 1, int(timestamp.sample_in_epoch)
        epoch_start = epoch_start_record(self._epoch_start)
        return DataPosition(epoch_start, batches_done, samples_done, self.fabric.world_size, loader_state)

    def _set_resume_position(self, position: DataPosition) -> None:
        """A checkpoint's data position, checked against this run's loader before anything is loaded."""
        if self.state.dataloader is not None and position.batches_done and position.loader_state is None:
            check_resumable(position, self.state.dataloader, self.fabric.world_size)
        self._resume_position = position
        self._batches = None

    def _after_batch(self) -> None:
        state, fire = self.state, self.engine.fire
        clock_check = self._clock_check
        if clock_check.times_in_tokens:
            clock_check.check_tokens_counted(state.timestamp)
        if state.train_metrics:
            state.metrics.update(compute_metrics(state.train_metrics, "metrics/train"))
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
        counts = [batches_in(evaluator) for evaluator in evaluators]
        if self.fabric.world_size == 1:
            return True
        known = torch.tensor([-1 if count is None else count for count in counts], device=self.fabric.device)
        gathered = self.fabric.all_gather(known)
        return bool((known >= 0).all() and (gathered == known).all())

    def _preemption_requested(self) -> bool:
        """Whether any rank received SIGTERM (a collective: every rank asks at the same point)."""
        return self._preemption is not None and self._preemption.requested_anywhere(self.fabric)

    # --- evaluation and prediction ----------------------------------------------------------------

    def eval(self, eval_dataloader: Any = None, subset_num_batches: int | None = None) -> dict[str, float]:
        """Run every evaluator once (or the given dataloader(s)) between EVAL_STANDALONE_START and
        EVAL_STANDALONE_END; returns the computed metrics."""
        if eval_dataloader is not None:
            self._set_evaluators(eval_dataloader)
        if not self.evaluators:
            raise ValueError("eval() needs an eval_dataloader: pass it to the Trainer or to eval().")
        if subset_num_batches is not None:
            for evaluator in self.evaluators:
                evaluator.subset_num_batches = subset_num_batches
        with self._failures_logged():
            run_evaluators(self.state, self.engine, self.logger, self.evaluators, standalone=True)
        labels = tuple(f"metrics/{evaluator.label}/" for evaluator in self.evaluators)
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


def _make_saver(
    autoresume: bool, run_name: str | None, save_folder: str | None, **options: Any
) -> CheckpointSaver | None:
    """The saver the ``save_*`` options describe (None without ``save_folder``); ``autoresume`` needs both names."""
    if autoresume and (save_folder is None or run_name is None):
        raise ValueError(
            f"autoresume=True needs save_folder and run_name (got save_folder={save_folder!r}, "
            f"run_name={run_name!r}): they name where the earlier run of this job saved its checkpoints."
        )
    return None if save_folder is None else CheckpointSaver(save_folder, **options)


def _make_fabric(fabric: Fabric | None, choices: dict[str, Any]) -> Fabric:
    unknown = sorted(set(choices) - set(FABRIC_CHOICES))
    if unknown:
        raise TypeError(f"Trainer() got unexpected arguments {unknown}; Fabric choices are {list(FABRIC_CHOICES)}.")
    if fabric is not None and choices:
        raise ValueError(
            f"Pass either fabric= or the Fabric choices {sorted(choices)}, not both: that Fabric already decided them."
        )
    fabric = Fabric(**choices) if fabric is None else fabric
    refusal = fabric.strategy.trainer_refusal
    if refusal is not None:
        raise ValueError(f"The Trainer cannot run on {type(fabric.strategy).__name__} yet: {refusal}")
    return fabric


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
    if run_name is not None:
        if not run_name or "/" in run_name:
            raise ValueError(f"run_name={run_name!r} must be a non-empty name without '/'.")
        return run_name
    made = f"run-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{random.SystemRandom().getrandbits(24):06x}"
    return str(fabric.broadcast(made, src=0)) if fabric.world_size > 1 else made


def _start_engine(
    state: State, fabric: Fabric, loggers: list[Any], progress_bar: bool, passes: Sequence[AlgorithmPass]
) -> tuple[Logger, Engine]:
    """The logger facade and the engine that fires the events (algorithms ordered by ``passes``), after firing INIT
    (before the model is set up, so model surgery happens on the plain model)."""
    logger = connect_loggers(state, fabric, loggers, progress_bar)
    destinations = logger.destinations
    engine = Engine(state, logger, state.algorithms, state.callbacks, loggers=destinations, passes=passes)
    engine.run_event(Event.INIT)
    return logger, engine


def _find_resume_checkpoint(
    fabric: Fabric,
    run_name: str,
    save_folder: str,
    filename: str,
    latest_filename: str | None,
    storage_options: StorageOptions,
) -> str | None:
    """``autoresume``: the newest checkpoint of this run, found on rank 0 and shared, or None."""
    found = None
    if fabric.is_global_zero:
        found = find_resume_checkpoint(save_folder, filename, latest_filename, run_name, storage_options)
    return fabric.broadcast(found)


def _setup_model(
    fabric: Fabric, module: nn.Module, optimizers: list[Optimizer], compile_options: dict[str, Any] | None
) -> tuple[nn.Module, list[Optimizer]]:
    """The model and its optimizers set up on ``fabric`` (compiled with ``compile_options``, unless None)."""
    if not hasattr(module, "loss"):
        raise TypeError(
            f"{type(module).__name__} has no loss(outputs, batch) method; the Trainer needs one "
            "(or subclass fabric.trainer.model.TrainerModel)."
        )
    if optimizers:
        model, *set_up = fabric.setup(module, *optimizers, compile=compile_options)
    else:  # eval or predict only: setup() then returns the module alone
        model, set_up = fabric.setup(module, compile=compile_options), []
    if callable(getattr(module, "eval_forward", None)):
        model.mark_forward_method("eval_forward")
    return model, set_up


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
        saver.bind(checkpointer.save, run_name)
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


def _token_counter(given: TokenCounter | None, model: nn.Module) -> TokenCounter:
    """The Trainer's ``get_num_tokens_in_batch``, else the model's method of that name, else ``input_ids`` counting."""
    if given is not None:
        return given
    method = getattr(model, "get_num_tokens_in_batch", None)
    return method if callable(method) else count_tokens


def _bound_profiler(profiler: Profiler | None, run_name: str) -> list[Profiler]:
    """``Trainer(profiler=...)`` as a callback that knows the run name (for its trace folder)."""
    if profiler is None:
        return []
    if not isinstance(profiler, Profiler):
        raise TypeError(f"profiler must be a fabric.trainer.profiler.Profiler, got {type(profiler).__name__}.")
    profiler.bind(run_name)
    return [profiler]


def _positive_time(duration: Time[Any] | str | int, name: str) -> Time[Any]:
    """``duration`` as a Time (an int means epochs); it must be positive and not in ``dur``."""
    time = Time.from_input(duration, TimeUnit.EPOCH)
    if time.unit is TimeUnit.DURATION or time.value <= 0:
        raise ValueError(f"{name}={duration!r} must be a positive time in ep, ba, sp or tok.")
    return time


def _scaled_duration(duration: Time[Any] | str | int, ratio: float) -> Time[Any]:
    """``max_duration`` as a positive Time, scaled by the scale schedule ratio."""
    return _scaled(_positive_time(duration, "max_duration"), ratio)


def _scaled(time: Time[Any], ratio: float) -> Time[Any]:
    """``time`` scaled by a scale schedule ratio (at least 1 of its unit)."""
    return time if ratio == 1.0 else Time(max(1, round(time.value * ratio)), time.unit)


def _check_ratio(ratio: Any) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 0:
        raise ValueError(f"scale_schedule_ratio={ratio!r} must be positive.")


def _check_microbatch_size(
    size: int | str | None, fabric: Fabric, option: str = "device_train_microbatch_size"
) -> None:
    """``"auto"`` retries a batch on the ranks that fitted too, which only a replicating strategy (DDP) survives:
    a sharded model's collectives would pair up wrongly."""
    if size is None or size == "auto":
        if size == "auto" and fabric.world_size > 1 and not fabric.strategy.replicates_gradients:
            raise ValueError(
                f"{option}='auto' on several ranks needs strategy='ddp', got {type(fabric.strategy).__name__}."
            )
        return
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"device_train_microbatch_size={size!r} must be a positive int, 'auto' or None.")
