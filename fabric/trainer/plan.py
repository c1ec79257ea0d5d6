"""The Trainer's plan: every ``Trainer(...)`` and ``fit(...)`` argument resolved and checked once, into a frozen
description, before the Trainer changes anything or starts a process; ``Trainer.__init__`` and ``fit`` then apply it.

This is what :mod:`fabric.connector` does for ``Fabric(...)`` and :mod:`fabric_cli.plan` for the launcher: a
refusal is raised here, naming the value and what is accepted, never halfway through the set-up.

* :class:`LoopSettings`: the settings ``Trainer()`` takes and each ``fit()`` may replace (subsets, spinning,
  evaluation, scheduler stepping, microbatches). Each is checked when the settings are built, wherever the values
  come from, so ``Trainer()`` and ``fit()`` share one check per setting.
* :class:`TrainerPlan` (:func:`plan_trainer`): ``Trainer(...)``'s arguments, Composer's names translated
  (:mod:`fabric.trainer.migration`).
* :class:`StagePlan` (:func:`plan_stage`): ``fit(...)``'s arguments: the Trainer's settings with the given ones
  replaced, and what else the next stage changes.

The checks that need the Fabric (its strategy) run in :meth:`TrainerPlan.make_fabric`, before the launch.
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from fabric.fabric import Fabric
from fabric.plugins.precision.precision import Precision
from fabric.trainer.checkpoint.dataloader_position import keeps_own_position
from fabric.trainer.checkpoint.parts import check_ignore_paths, check_load_ignore_keys
from fabric.trainer.checkpoint.saver import SaveSettings
from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.callback import Callback
from fabric.trainer.core.passes import AlgorithmPass
from fabric.trainer.core.time import Time, TimeUnit
from fabric.trainer.data_spec import DataSpec, ensure_data_spec
from fabric.trainer.evaluation import Evaluator, ensure_evaluators
from fabric.trainer.intervals import IntervalInput, create_eval_interval
from fabric.trainer.migration import algorithm_passes as merged_passes
from fabric.trainer.migration import (
    apply_dist_timeout,
    check_compile_config,
    check_dist_timeout,
    check_exclude_algorithms,
    check_flag,
    check_grad_accum,
    check_spin_dataloaders,
    check_subset_num_batches,
    console_loggers,
    load_path_from,
    strict_model_weights,
    take_composer_arguments,
    translate_fabric_choices,
)
from fabric.trainer.parallelism import SequenceSplit, sequence_split_from
from fabric.trainer.pipeline import check_pipeline_settings, pipeline_network
from fabric.trainer.profiler import Profiler
from fabric.trainer.stages import default_optimizer, precision_for_fit
from fabric.trainer.train_step import TokenCounter, count_tokens
from fabric.utilities.apply_func import as_list
from fabric.utilities.cli_contract import FABRIC_CHOICES
from fabric.utilities.seed import MAX_SEED, check_seed_range


@dataclass(frozen=True)
class LoopSettings:
    """The settings ``Trainer()`` takes and ``fit()`` may replace; every value is checked when this is built."""

    train_subset_num_batches: int = -1
    spin_dataloaders: bool = True
    eval_subset_num_batches: int = -1
    eval_interval: IntervalInput = 1
    #: None: Composer's default (every batch, unless a PyTorch scheduler is among the schedulers).
    step_schedulers_every_batch: bool | None = None
    #: As given (``"auto"`` halves on out-of-memory errors); None: whole batches, or ``grad_accum``'s.
    device_train_microbatch_size: int | str | None = None
    #: Composer's numeric ``grad_accum``: microbatches of the train dataloader's batch size divided by it.
    grad_accum: int | None = None

    def __post_init__(self) -> None:
        check_subset_num_batches(self.train_subset_num_batches, "train_subset_num_batches")
        check_flag(self.spin_dataloaders, "spin_dataloaders")
        check_subset_num_batches(self.eval_subset_num_batches, "eval_subset_num_batches")
        create_eval_interval(self.eval_interval)  # each evaluator builds its own from it later
        if self.step_schedulers_every_batch is not None:
            check_flag(self.step_schedulers_every_batch, "step_schedulers_every_batch")
        check_microbatch_size(self.device_train_microbatch_size, "device_train_microbatch_size")

    def check_train_loader(self, dataloader: object) -> None:
        """``spin_dataloaders=False`` (checked to be a flag when these settings were built) is only for a train
        dataloader that resumes itself."""
        check_spin_dataloaders(self.spin_dataloaders, dataloader, keeps_own_position)

    def check_on(self, fabric: Fabric) -> None:
        """The checks that need the Fabric's strategy."""
        check_auto_microbatching(self.device_train_microbatch_size, fabric, "device_train_microbatch_size")
        microbatches = {
            "device_train_microbatch_size": self.device_train_microbatch_size,
            "grad_accum": self.grad_accum,
        }
        check_pipeline_settings(fabric.strategy, microbatches)


#: The names of the settings, which are also ``Trainer()``'s and ``fit()``'s parameter names.
SETTING_NAMES = tuple(field.name for field in fields(LoopSettings))


@dataclass(frozen=True)
class LoadPlan:
    """The checkpoint to load at set-up, with its options (``load_path``, ``load_weights_only``, ...)."""

    path: str | None = None
    weights_only: bool = False
    strict: bool = True
    ignore_keys: tuple[str, ...] = ()
    #: Algorithm class names whose recorded surgery is not re-applied before the load.
    excluded_algorithms: tuple[str, ...] = ()
    #: Autoresume found this run's newest checkpoint.
    resumed: bool = False

    def resumed_from(self, checkpoint: str) -> LoadPlan:
        """Autoresume's checkpoint instead, loaded whole: it continues this run (``load_path`` starts one)."""
        return replace(self, path=checkpoint, weights_only=False, ignore_keys=(), resumed=True)


@dataclass(frozen=True)
class TrainerPlan:
    """``Trainer(...)``'s arguments resolved and checked (:func:`plan_trainer`); the Trainer applies it once."""

    model: nn.Module
    train_data: DataSpec | None
    evaluators: tuple[Evaluator, ...]
    #: Scaled by ``scale_schedule_ratio``.
    max_duration: Time[Any] | None
    settings: LoopSettings
    scale_schedule_ratio: float
    optimizers: tuple[Optimizer, ...]
    #: The optimizers are Composer's default (``DecoupledSGDW(lr=0.1)``), said once the set-up succeeded.
    optimizer_defaulted: bool
    schedulers: tuple[Any, ...]
    algorithms: tuple[Algorithm, ...]
    passes: tuple[AlgorithmPass, ...]
    callbacks: tuple[Callback, ...]
    profiler: Profiler | None
    loggers: tuple[Any, ...]
    progress_bar: bool
    seed: int | None
    run_name: str | None
    #: What the Trainer's saver saves, where and how often (None without ``save_folder``).
    save: SaveSettings | None
    autoresume: bool
    load: LoadPlan
    storage_options: Mapping[str, Any] | None
    save_ignore_keys: tuple[str, ...]
    save_metrics: bool
    compile_options: Mapping[str, Any] | None
    token_counter: TokenCounter
    accumulate_on_tokens: bool
    #: What ``parallelism_config["cp"]`` splits along the sequence around each microbatch (None without it).
    sequence_split: SequenceSplit | None
    deterministic_mode: bool
    fabric: Fabric | None
    fabric_choices: Mapping[str, Any]
    dist_timeout: float | None

    def make_fabric(self) -> Fabric:
        """The given Fabric, or one made from the choices, checked against what the Trainer needs (not launched)."""
        fabric = Fabric(**self.fabric_choices) if self.fabric is None else self.fabric
        if self.dist_timeout is not None:
            apply_dist_timeout(fabric, self.dist_timeout)
        self.settings.check_on(fabric)
        check_eval_microbatching(self.evaluators, fabric)
        _check_sequence_split(fabric, self.sequence_split)
        if fabric.strategy.pipeline is not None:
            pipeline_network(fabric.strategy.pipeline, self.model)
            check_pipeline_settings(fabric.strategy, {"accumulate_train_batch_on_tokens": self.accumulate_on_tokens})
        return fabric


def plan_trainer(arguments: Mapping[str, Any]) -> TrainerPlan:
    """``Trainer(...)``'s arguments (by parameter name, ``fabric_choices`` holding the rest) checked and resolved."""
    given = dict(arguments)
    choices = dict(given.pop("fabric_choices"))
    take_composer_arguments(choices)
    model = given["model"]
    train_data = None if given["train_dataloader"] is None else ensure_data_spec(given["train_dataloader"])
    settings = _initial_settings(given)
    settings.check_train_loader(None if train_data is None else train_data.dataloader)
    ratio = check_ratio(given["scale_schedule_ratio"])
    schedulers = tuple(as_list(given["schedulers"]))
    defaulted = given["optimizers"] is None and (train_data is not None or bool(schedulers))
    optimizers = tuple(as_list(default_optimizer(model) if defaulted else given["optimizers"]))
    plan = TrainerPlan(
        model=model,
        train_data=train_data,
        evaluators=tuple(ensure_evaluators(given["eval_dataloader"])),
        max_duration=_max_duration(given["max_duration"], ratio),
        settings=settings,
        scale_schedule_ratio=ratio,
        optimizers=optimizers,
        optimizer_defaulted=defaulted,
        schedulers=schedulers,
        algorithms=tuple(as_list(given["algorithms"])),
        passes=tuple(merged_passes(given["algorithm_passes"])),
        callbacks=tuple(as_list(given["callbacks"])),
        profiler=_checked_profiler(given["profiler"]),
        progress_bar=check_flag(given["progress_bar"], "progress_bar"),
        loggers=tuple(_loggers(given)),
        seed=check_seed(given["seed"]),
        run_name=check_run_name(given["run_name"]),
        storage_options=check_storage_options(given["storage_options"]),
        save=_save_settings(given),
        autoresume=given["autoresume"],
        load=_load_plan(given),
        save_ignore_keys=check_ignore_paths(given["save_ignore_keys"], "save_ignore_keys"),
        save_metrics=check_flag(given["save_metrics"], "save_metrics"),
        compile_options=_read_only(check_compile_config(given["compile_config"], model)),
        token_counter=_token_counter(given["get_num_tokens_in_batch"], model),
        accumulate_on_tokens=check_flag(given["accumulate_train_batch_on_tokens"], "accumulate_train_batch_on_tokens"),
        sequence_split=sequence_split_from(given["parallelism_config"]),
        deterministic_mode=check_flag(given["deterministic_mode"], "deterministic_mode"),
        fabric=given["fabric"],
        fabric_choices=MappingProxyType(_fabric_choices(given, choices)),
        dist_timeout=check_dist_timeout(given["dist_timeout"], fabric_given=given["fabric"] is not None),
    )
    # What the set-up would refuse, after every argument's own check (as it was refused after them at set-up).
    check_trainer_model(model)
    check_schedulers_have_optimizers(schedulers, has_optimizers=bool(optimizers))
    return plan


def _check_sequence_split(fabric: Fabric, split: SequenceSplit | None) -> None:
    """A mesh with context parallelism needs the ``cp`` section's ``seq_dims``: which batch entries to split."""
    # A ModelParallelStrategy exists only once its module is loaded: importing it here would load FSDP, DCP and
    # DTensor (0.4 s) into every run.
    model_parallel = sys.modules.get("fabric.strategies.model_parallel")
    if (
        split is None
        and model_parallel is not None
        and isinstance(fabric.strategy, model_parallel.ModelParallelStrategy)
    ):
        degree = fabric.strategy.mesh_plan().resolved_degrees["context_parallel"]
        if degree > 1:
            raise ValueError(
                f"The mesh has context_parallel={degree}, but the Trainer does not know which batch entries hold "
                "sequences: pass parallelism_config={'cp': {'context_parallel_degree': "
                f"{degree}, 'seq_dims': {{'input_ids': 1, 'labels': 1}}}}, ...}} instead of the strategy."
            )


def _loggers(given: Mapping[str, Any]) -> list[Any]:
    """The given loggers, with the console logger ``log_to_console`` asks for."""
    console = given["log_to_console"], given["console_log_interval"], given["console_stream"]
    return console_loggers(*console, as_list(given["loggers"]), given["progress_bar"])


def _initial_settings(given: Mapping[str, Any]) -> LoopSettings:
    """The settings as ``Trainer()`` was given them (``grad_accum`` resolved into the microbatch settings)."""
    grad_accum = given["grad_accum"]
    return LoopSettings(
        train_subset_num_batches=given["train_subset_num_batches"],
        spin_dataloaders=given["spin_dataloaders"],
        eval_subset_num_batches=given["eval_subset_num_batches"],
        eval_interval=given["eval_interval"],
        step_schedulers_every_batch=given["step_schedulers_every_batch"],
        device_train_microbatch_size=check_grad_accum(grad_accum, given["device_train_microbatch_size"]),
        grad_accum=grad_accum if isinstance(grad_accum, int) else None,
    )


def _save_settings(given: Mapping[str, Any]) -> SaveSettings | None:
    """The ``save_*`` options checked (None without ``save_folder``); ``autoresume`` needs both names."""
    folder, run_name = given["save_folder"], given["run_name"]
    for flag in ("save_weights_only", "save_overwrite", "save_async"):  # also without save_folder: checked either way
        check_flag(given[flag], flag)
    if check_flag(given["autoresume"], "autoresume") and (folder is None or run_name is None):
        raise ValueError(
            f"autoresume=True needs save_folder and run_name (got save_folder={folder!r}, "
            f"run_name={run_name!r}): they name where the earlier run of this job saved its checkpoints."
        )
    if folder is None:
        return None
    return SaveSettings(
        folder,
        filename=given["save_filename"],
        latest_filename=given["save_latest_filename"],
        save_interval=given["save_interval"],
        num_checkpoints_to_keep=given["save_num_checkpoints_to_keep"],
        weights_only=given["save_weights_only"],
        overwrite=given["save_overwrite"],
        storage_options=given["storage_options"],
        async_save=given["save_async"],
    )


def _load_plan(given: Mapping[str, Any]) -> LoadPlan:
    return LoadPlan(
        path=load_path_from(given["load_path"], given["load_path_format"]),
        weights_only=check_flag(given["load_weights_only"], "load_weights_only"),
        strict=strict_model_weights(given["load_strict"], given["load_strict_model_weights"]),
        ignore_keys=check_load_ignore_keys(given["load_ignore_keys"]),  # names no part: refused now, not at the load
        excluded_algorithms=check_exclude_algorithms(given["load_exclude_algorithms"]),
    )


def _read_only(options: dict[str, Any] | None) -> Mapping[str, Any] | None:
    return None if options is None else MappingProxyType(options)


def _fabric_choices(given: Mapping[str, Any], choices: Mapping[str, Any]) -> dict[str, Any]:
    """Fabric's choices from the Trainer's remaining keyword arguments and Composer's ``device``,
    ``deepspeed_config`` and ``parallelism_config``; empty when a ready ``fabric=`` is given."""
    parallelism_config, fabric = given["parallelism_config"], given["fabric"]
    if parallelism_config is not None and fabric is not None:
        raise ValueError("Pass either fabric= or parallelism_config=, not both: that Fabric already has its strategy.")
    translated = translate_fabric_choices(
        choices, given["device"], given["deepspeed_config"], parallelism_config, given["model"]
    )
    unknown = sorted(set(translated) - set(FABRIC_CHOICES))
    if unknown:
        raise TypeError(f"Trainer() got unexpected arguments {unknown}; Fabric choices are {list(FABRIC_CHOICES)}.")
    if fabric is not None and translated:
        raise ValueError(
            f"Pass either fabric= or the Fabric choices {sorted(translated)}, not both: that Fabric already decided "
            "them."
        )
    return translated


def _checked_profiler(profiler: object) -> Profiler | None:
    if profiler is not None and not isinstance(profiler, Profiler):
        raise TypeError(f"profiler must be a fabric.trainer.profiler.Profiler, got {type(profiler).__name__}.")
    return profiler


def _token_counter(given: TokenCounter | None, model: nn.Module) -> TokenCounter:
    """The Trainer's ``get_num_tokens_in_batch``, else the model's method of that name, else ``input_ids`` counting."""
    if given is not None:
        return given
    method = getattr(model, "get_num_tokens_in_batch", None)
    return method if callable(method) else count_tokens


@dataclass(frozen=True)
class StagePlan:
    """``fit(...)``'s arguments checked (:func:`plan_stage`): the settings from now on and what else changes."""

    settings: LoopSettings
    #: The settings ``fit()`` was given (the others stay as they were).
    given_settings: frozenset[str]
    train_data: DataSpec | None
    #: ``duration``: how much longer to train, from the current time (after ``reset_time``).
    extra_duration: Time[Any] | None
    reset_time: bool
    scale_schedule_ratio: float
    schedulers: list[Any] | None
    #: ``eval_dataloader`` as evaluators (None: the Trainer's stay).
    evaluators: list[Evaluator] | None
    optimizers: Any
    precision: Precision | None


def _max_duration(max_duration: Time[Any] | str | int | None, ratio: float) -> Time[Any] | None:
    """``max_duration`` checked and scaled by ``scale_schedule_ratio``."""
    return None if max_duration is None else scaled(positive_time(max_duration, "max_duration"), ratio)


def _stage_evaluators(eval_dataloader: Any, given: set[str], evaluates: bool, fabric: Fabric) -> list[Evaluator] | None:
    """``fit(eval_dataloader=)`` as evaluators (``None``: keep the Trainer's), refusing evaluation settings given
    with nothing to evaluate."""
    if {"eval_interval", "eval_subset_num_batches"} & given and eval_dataloader is None and not evaluates:
        raise ValueError(
            "fit(eval_interval=/eval_subset_num_batches=) set how to evaluate, but there is no eval_dataloader: "
            "pass eval_dataloader= as well."
        )
    evaluators = None if eval_dataloader is None else ensure_evaluators(eval_dataloader)
    check_eval_microbatching(evaluators or [], fabric)
    return evaluators


def plan_stage(
    arguments: Mapping[str, Any],
    settings: LoopSettings,
    fabric: Fabric,
    *,
    train_loader: object,
    evaluates: bool,
    has_optimizers: bool = True,
) -> StagePlan:
    """``fit(...)``'s arguments (by parameter name) checked against the Trainer's ``settings``, its ``fabric``, its
    current ``train_loader``, whether it ``evaluates`` (has evaluators) and whether it ``has_optimizers``."""
    # Composer's train_dataloader_label: only its default (a missing one is the default).
    take_composer_arguments({"train_dataloader_label": arguments.get("train_dataloader_label", "train")})
    given = {name: arguments[name] for name in SETTING_NAMES if arguments.get(name) is not None}
    if "device_train_microbatch_size" in given:
        given["grad_accum"] = None  # an explicit microbatch size replaces grad_accum's
    new_settings = replace(settings, **given)
    train_data = None if arguments["train_dataloader"] is None else ensure_data_spec(arguments["train_dataloader"])
    new_settings.check_train_loader(train_loader if train_data is None else train_data.dataloader)
    new_settings.check_on(fabric)
    ratio, schedulers = check_ratio(arguments["scale_schedule_ratio"]), arguments["schedulers"]
    if ratio != 1.0 and schedulers is None:
        raise ValueError(
            f"fit(scale_schedule_ratio={ratio}) scales the schedulers given with it (and max_duration); pass "
            "schedulers= too, as in Composer."
        )
    evaluators = _stage_evaluators(arguments["eval_dataloader"], set(given), evaluates, fabric)
    duration, precision = arguments["duration"], arguments["precision"]
    if schedulers is not None:  # new optimizers given with them are checked when they are set up
        check_schedulers_have_optimizers(
            as_list(schedulers), has_optimizers=has_optimizers or arguments["optimizers"] is not None
        )
    return StagePlan(
        settings=new_settings,
        given_settings=frozenset(given),
        train_data=train_data,
        extra_duration=None if duration is None else positive_time(duration, "duration"),
        reset_time=check_flag(arguments["reset_time"], "fit(reset_time)"),
        scale_schedule_ratio=ratio,
        schedulers=None if schedulers is None else as_list(schedulers),
        evaluators=evaluators,
        optimizers=arguments["optimizers"],
        precision=None if precision is None else precision_for_fit(fabric, precision),
    )


# --- the checks both plans (and the evaluators) share -------------------------------------------------


def check_microbatch_size(size: object, option: str) -> None:
    """A microbatch size: a positive int, ``"auto"`` or None."""
    if size is None or size == "auto":
        return
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{option}={size!r} must be a positive int, 'auto' or None.")


def check_auto_microbatching(size: object, fabric: Fabric, option: str) -> None:
    """``"auto"`` retries a batch on the ranks that fitted too, which only a replicating strategy (DDP) survives:
    a sharded model's collectives would pair up wrongly."""
    if size == "auto" and fabric.world_size > 1 and not fabric.strategy.replicates_gradients:
        raise ValueError(
            f"{option}='auto' on several ranks needs strategy='ddp', got {type(fabric.strategy).__name__}."
        )


def check_eval_microbatching(evaluators: Sequence[Evaluator], fabric: Fabric) -> None:
    """Each evaluator's ``device_eval_microbatch_size='auto'`` against the strategy (see
    :func:`check_auto_microbatching`)."""
    for evaluator in evaluators:
        check_auto_microbatching(evaluator.device_eval_microbatch_size, fabric, "device_eval_microbatch_size")


def plan_evaluators(eval_dataloader: Any, fabric: Fabric) -> list[Evaluator]:
    """``eval(eval_dataloader=...)``: the evaluators, checked against ``fabric`` as ``Trainer()`` and ``fit()`` check
    theirs."""
    evaluators = ensure_evaluators(eval_dataloader)
    check_eval_microbatching(evaluators, fabric)
    return evaluators


def check_trainer_model(model: object) -> None:
    """The Trainer's model needs ``loss(outputs, batch)``."""
    if not hasattr(model, "loss"):
        raise TypeError(
            f"{type(model).__name__} has no loss(outputs, batch) method; the Trainer needs one "
            "(or subclass fabric.trainer.model.TrainerModel)."
        )


def check_schedulers_have_optimizers(schedulers: Sequence[Any], *, has_optimizers: bool) -> None:
    """Composer's schedulers (``fabric.trainer.schedulers``) set the optimizers' learning rates: they need some.
    PyTorch ``LRScheduler`` objects hold their optimizer already."""
    ours = [scheduler for scheduler in schedulers if not isinstance(scheduler, LRScheduler)]
    if ours and not has_optimizers:
        raise ValueError(f"schedulers={ours} need optimizers to schedule; pass optimizers=... as well.")


def check_seed(seed: object) -> int | None:
    """``seed``: None (one is drawn on rank 0 and shared at the launch) or an int in the range every generator
    takes (Composer's ``seed``; a bool is refused)."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed={seed!r} is not valid. Accepted: None or an int in [0, {MAX_SEED}].")
    return check_seed_range(int(seed))


def check_storage_options(options: object) -> Mapping[str, Any] | None:
    """``storage_options``: None or a dict of fsspec options (an object store's endpoint, credentials)."""
    if options is not None and not isinstance(options, Mapping):
        raise ValueError(
            f"storage_options={options!r} is not valid. Accepted: None or a dict of fsspec options, e.g. "
            "{'client_kwargs': {'endpoint_url': ...}, 'key': ..., 'secret': ...}."
        )
    return options


def check_ratio(ratio: object) -> float:
    """``scale_schedule_ratio``: a positive number."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 0:
        raise ValueError(f"scale_schedule_ratio={ratio!r} must be positive.")
    return float(ratio)


def check_run_name(run_name: object) -> str | None:
    """``run_name``: None (one is made and shared at the launch) or a non-empty name without ``/``."""
    if run_name is not None and (not isinstance(run_name, str) or not run_name or "/" in run_name):
        raise ValueError(f"run_name={run_name!r} must be a non-empty name without '/'.")
    return run_name


def positive_time(duration: Time[Any] | str | int, name: str) -> Time[Any]:
    """``duration`` as a Time (an int means epochs); it must be positive and not in ``dur``."""
    time = Time.from_input(duration, TimeUnit.EPOCH)
    if time.unit is TimeUnit.DURATION or time.value <= 0:
        raise ValueError(f"{name}={duration!r} must be a positive time in ep, ba, sp or tok.")
    return time


def scaled(time: Time[Any], ratio: float) -> Time[Any]:
    """``time`` scaled by a scale schedule ratio (at least 1 of its unit)."""
    return time if ratio == 1.0 else Time(max(1, round(time.value * ratio)), time.unit)
