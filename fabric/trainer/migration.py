"""Composer's argument names that the Trainer accepts with Composer's meaning, without warnings.

* ``device="cpu" | "gpu" | "mps"``: the same as ``accelerator=`` (both given and disagreeing is an error).
* ``precision="amp"``: Composer's automatic mixed precision, float16 autocast with loss scaling, i.e.
  ``"16-mixed"`` (also spelled ``"amp_fp16"``). Composer refuses it on a CPU; here it runs float16 autocast
  on the CPU with a GradScaler (``"amp_bf16"`` is the CPU choice measured fast where the CPU has bfloat16
  instructions).
* ``deepspeed_config={...}``: train with the DeepSpeed strategy configured by that dict (``{}``: its defaults).
* ``load_path_format``: the same as ``load_path``.
* ``grad_accum=N``: split every batch into ``N`` microbatches, i.e. ``device_train_microbatch_size`` of the
  train dataloader's ``batch_size / N`` (which must divide); ``grad_accum="auto"`` is
  ``device_train_microbatch_size="auto"``.

Every other Composer ``Trainer`` argument is accepted with Composer's meaning or refused by name with a
``ValueError`` saying what to use instead (when the Trainer is built), never a bare ``TypeError``:

* ``train_subset_num_batches``: accepted; at most that many batches per epoch (``-1``: all), the epoch ending there
  as after ``itertools.islice`` (``state.dataloader_len`` is the subset, as in Composer). Also a ``fit()`` argument.
* ``eval_subset_num_batches``: accepted (as before; also ``fit()`` and ``eval(subset_num_batches=)``).
* ``spin_dataloaders``: ``True`` (Composer's default) accepted, with nothing to do: a resume restores the epoch's
  order from the checkpoint and starts at the first unseen batch (by index, without re-reading the seen ones), which
  is what spinning the dataloader achieves. ``False`` accepted for dataloaders that resume themselves
  (``state_dict()``/``load_state_dict()``: StreamingDataLoader, StatefulDataLoader), what Composer's ``False`` is
  for; refused for other dataloaders, whose resumed epoch Composer would restart from its first batch.
* ``dist_timeout``: accepted; seconds, the strategy's ``timeout`` for the process group and every collective, set
  before the launch (default: the strategy's 30 minutes; Composer's is 300 s). No effect in one process. Refused
  together with ``fabric=`` (that Fabric's strategy has its timeout).
* ``deterministic_mode``: accepted; ``torch.use_deterministic_algorithms(True)``, cuDNN deterministic without
  benchmarking and ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, before the launch, with Composer's warning.
* ``compile_config``: accepted; ``None`` compiles nothing, a dict (``{}``: the defaults) is ``torch.compile``'s
  arguments, given to ``fabric.setup(model, compile=...)`` (compiled around the strategy's wrapper).
* ``log_to_console``, ``console_log_interval``, ``console_stream``: accepted; add a ``ConsoleLogger`` printing the
  metrics every ``console_log_interval`` (default ``"1ba"``) to ``console_stream`` (``"stderr"``, ``"stdout"`` or a
  stream), unless one is among the loggers; with the progress bar on, Composer's warning.
* ``save_ignore_keys``: accepted; Composer's paths and globs (``"state/model/*"``, ``"state/optimizers"``,
  ``"rng"``) leave those parts out of every checkpoint (:mod:`fabric.trainer.checkpoint.parts`); a function
  editing the state dict is refused.
* ``save_metrics``: accepted; checkpoints also hold the train and eval metric objects' states and the latest
  computed values (``state.metrics``), restored at load. (Metrics are computed and reset every batch or round, so
  at a checkpoint the objects hold no accumulated values.)
* ``load_ignore_keys``: accepted; the part names it took before, and Composer's paths of whole parts; paths to
  single model weights are refused.
* ``load_weights_only``: accepted (as before).
* ``load_strict_model_weights``: accepted, Composer's name for ``load_strict``; it defaults to ``True`` here
  (Composer: ``False``), and ``False`` also lets whole entries be missing.
* ``load_exclude_algorithms``: accepted; algorithm class names (``"BlurPool"``) whose surgery, recorded in the
  checkpoint, is not re-applied before it loads.
* ``algorithm_passes``: accepted; functions ``(algorithms, event) -> list``, or ``(function, index)`` pairs, added to
  the default passes as Composer's Engine registers them (appended, or inserted at ``index``).
* ``parallelism_config``: ``{"fsdp": {...}, "tp": {...}}`` accepted as an ``FSDPStrategy`` (``ModelParallelStrategy``
  with ``tp``) on a ``MeshPlan`` of the degrees, each key mapped or refused by name
  (:mod:`fabric.trainer.parallelism`).
* ``fsdp_config``, ``fsdp_auto_wrap``: refused, Composer's older names for ``parallelism_config={"fsdp": ...}``.
* ``python_log_level``: applied (:data:`APPLIED`, :func:`configure_python_logging`).
* ``precision_config``, ``ddp_sync_strategy``, ``load_object_store``, ``auto_log_hparams``, ``log_traces``,
  ``train_dataloader_label`` (also a ``fit()`` argument): their defaults accepted (they change nothing here);
  other values refused, naming the alternative (:data:`REFUSED`). ``load_progress_bar``: either value accepted;
  no download progress bar is shown.

``Trainer.fit()`` takes Composer's per-stage arguments (see :meth:`fabric.trainer.trainer.Trainer.fit` and
:mod:`fabric.trainer.stages`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TextIO, cast

from torch import nn

from fabric.accelerators.registry import GPU_ACCELERATORS
from fabric.trainer.core.passes import DEFAULT_PASSES, AlgorithmPass
from fabric.trainer.intervals import IntervalInput, create_interval
from fabric.utilities.compile import uncompiled
from fabric.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from fabric.fabric import Fabric
    from fabric.trainer.loggers.console import ConsoleLogger

_DEVICES = ("cpu", "gpu", "mps")

#: Composer arguments whose listed values change nothing here (accepted), with what to use for any other value.
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "fsdp_config": ((None,), "it is Composer's older name: pass parallelism_config={'fsdp': {...}}"),
    "fsdp_auto_wrap": ((), "it is Composer's older name: pass parallelism_config={'fsdp': {'auto_wrap': ...}}"),
    "precision_config": (
        (None,),
        "TransformerEngine's FP8 settings are not used: precision='amp_fp8' trains in float8 on torchao; for its "
        "recipe or layer filter pass fabric=Fabric(plugins=Float8Precision(...))",
    ),
    "ddp_sync_strategy": (
        (None,),
        "DDP synchronises the gradients in the backward of each batch's last microbatch; configure DDP itself with "
        "strategy=DDPStrategy(...)",
    ),
    "load_object_store": (
        (None,),
        "pass an fsspec URL as load_path (s3://bucket/checkpoint.pt), with storage_options= for the endpoint and "
        "credentials",
    ),
    "auto_log_hparams": ((False,), "log them yourself: trainer.logger.log_hyperparameters({...})"),
    "load_progress_bar": ((True, False), "no download progress bar is shown"),
    "log_traces": ((False,), "algorithm traces are not logged"),
    "train_dataloader_label": (
        ("train",),
        "the train dataloader's label is 'train' (metrics are logged as metrics/train/<name>)",
    ),
}


_LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


def configure_python_logging(level: str | None) -> None:
    """Composer's ``python_log_level``: Python's logging prints each record with the process's rank (records of the
    program and its libraries; the Trainer itself reports through its console logger), and the ``composer`` and
    ``fabric`` loggers take ``level``."""
    if level is None:
        return
    if not isinstance(level, str) or level.upper() not in _LOG_LEVELS:
        names = [name.lower() for name in _LOG_LEVELS]
        raise ValueError(f"Trainer(python_log_level={level!r}) is not a logging level: use one of {names}.")
    logging.basicConfig(
        format=f"%(asctime)s: rank{os.environ.get('RANK', '0')}[%(process)d][%(threadName)s]: %(levelname)s: "
        "%(name)s: %(message)s"
    )
    for name in ("composer", "fabric"):
        logging.getLogger(name).setLevel(level.upper())


#: Composer arguments the Trainer takes from its keyword arguments and applies at once.
APPLIED: dict[str, Callable[[Any], None]] = {"python_log_level": configure_python_logging}


def take_composer_arguments(choices: dict[str, Any]) -> None:
    """Take Composer's arguments of :data:`APPLIED` and :data:`REFUSED` out of ``choices`` (the Trainer's remaining
    keyword arguments): the first are applied; the others accepted with a value that changes nothing here, else
    ``ValueError`` naming what to use instead."""
    for name in [name for name in choices if name in APPLIED]:
        APPLIED[name](choices.pop(name))
    for name in [name for name in choices if name in REFUSED]:
        value = choices.pop(name)
        accepted, instead = REFUSED[name]
        if not any(value is default or (type(value) is type(default) and value == default) for default in accepted):
            raise ValueError(f"Trainer({name}={value!r}) is not supported: {instead}.")


def translate_fabric_choices(
    choices: Mapping[str, Any],
    device: str | None,
    deepspeed_config: Mapping[str, Any] | None,
    parallelism_config: object = None,
    model: nn.Module | None = None,
) -> dict[str, Any]:
    """``choices`` (the Trainer's Fabric arguments) with ``device``, ``precision="amp"``, ``deepspeed_config`` and
    ``parallelism_config`` turned into Fabric's ``accelerator``, ``precision`` and ``strategy``."""
    translated = dict(choices)
    if device is not None:
        translated["accelerator"] = _accelerator_for(device, choices.get("accelerator"))
    if translated.get("precision") == "amp":
        translated["precision"] = "16-mixed"
    if deepspeed_config is not None:
        if parallelism_config is not None:
            raise ValueError("deepspeed_config= and parallelism_config= each choose the strategy; pass only one.")
        translated["strategy"] = _deepspeed_strategy(deepspeed_config, choices.get("strategy"))
    if parallelism_config is not None:
        from fabric.trainer.parallelism import strategy_from

        assert model is not None
        strategy = strategy_from(parallelism_config, model)
        if strategy is not None:
            if choices.get("strategy") not in (None, "auto", "fsdp"):
                raise ValueError(
                    f"parallelism_config selects {type(strategy).__name__}, but strategy={choices['strategy']!r} "
                    f"was given too. Pass only parallelism_config= (or strategy={type(strategy).__name__}(...))."
                )
            translated["strategy"] = strategy
    return translated


def _accelerator_for(device: str, accelerator: object) -> Any:
    if device not in _DEVICES:
        raise ValueError(
            f"device={device!r} is not valid. Accepted: {', '.join(map(repr, _DEVICES))} (Composer's name for "
            "accelerator=; Fabric's accelerator= takes more)."
        )
    if accelerator is None or accelerator == device:
        return device
    if device == "gpu" and accelerator in ("gpu", *GPU_ACCELERATORS):
        return accelerator  # the more precise of two names that agree
    raise ValueError(
        f"device={device!r} and accelerator={accelerator!r} disagree: device is Composer's name for accelerator. "
        "Pass only one of them."
    )


def _deepspeed_strategy(config: Mapping[str, Any], strategy: object) -> Any:
    if not isinstance(config, Mapping):
        raise TypeError(f"deepspeed_config must be a dict (DeepSpeed's JSON config), got {type(config).__name__}.")
    if strategy not in (None, "auto", "deepspeed"):
        raise ValueError(
            f"deepspeed_config= selects the DeepSpeed strategy, but strategy={strategy!r} was given too. "
            "Pass only deepspeed_config= (or strategy=DeepSpeedStrategy(config=...))."
        )
    from fabric.strategies.deepspeed.strategy import DeepSpeedStrategy

    return DeepSpeedStrategy(config=dict(config))


def load_path_from(load_path: str | None, load_path_format: str | None) -> str | None:
    """``load_path``, or Composer's older name for it, ``load_path_format``; both given is an error."""
    if load_path_format is None:
        return load_path
    if load_path is not None and load_path != load_path_format:
        raise ValueError(
            f"load_path={load_path!r} and load_path_format={load_path_format!r} disagree: load_path_format is "
            "Composer's older name for load_path. Pass only one of them."
        )
    return load_path_format


def check_grad_accum(grad_accum: int | str | None, microbatch_size: int | str | None) -> int | str | None:
    """The ``device_train_microbatch_size`` to start with: ``"auto"`` for ``grad_accum="auto"``, else the given one.

    A numeric ``grad_accum`` is resolved per train dataloader by :func:`microbatch_size_for`.
    """
    if grad_accum is None:
        return microbatch_size
    if microbatch_size is not None:
        raise ValueError(
            f"grad_accum={grad_accum!r} and device_train_microbatch_size={microbatch_size!r} both set the "
            "microbatches: pass only one of them."
        )
    if grad_accum == "auto":
        return "auto"
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"grad_accum={grad_accum!r} must be a positive int (microbatches per batch) or 'auto'.")
    return None


def microbatch_size_for(grad_accum: int, dataloader: object) -> int | None:
    """Samples per microbatch so a batch of the train dataloader runs as ``grad_accum`` microbatches."""
    size = getattr(dataloader, "batch_size", None)
    if isinstance(size, bool) or not isinstance(size, int):
        raise ValueError(
            f"grad_accum={grad_accum} splits each batch into {grad_accum} microbatches, which needs the train "
            f"dataloader's batch_size; this {type(dataloader).__name__} has none. Pass "
            "device_train_microbatch_size=<samples per microbatch> instead."
        )
    if size % grad_accum:
        raise ValueError(
            f"grad_accum={grad_accum} does not divide the train dataloader's batch_size={size}: the microbatches "
            f"would differ in size. Use a grad_accum that divides {size}, or device_train_microbatch_size=."
        )
    return None if grad_accum == 1 else size // grad_accum


# --- Composer's other Trainer arguments -------------------------------------------------------------


def check_subset_num_batches(value: object, name: str) -> int:
    """``train_subset_num_batches`` / ``eval_subset_num_batches``: ``-1`` (all) or a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise ValueError(f"{name}={value!r} is not valid. Accepted: -1 (every batch) or a positive int.")
    return value


def check_flag(value: object, name: str) -> bool:
    """A True/False argument, or ``ValueError`` naming it."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not valid. Accepted: True or False.")
    return value


def check_spin_dataloaders(spin: bool, dataloader: object, keeps_own_position: Callable[[Any], bool]) -> None:
    """``spin_dataloaders`` (a flag, checked where the settings are built: ``LoopSettings``): ``True`` changes
    nothing; ``False`` only for a loader that resumes itself."""
    if spin or dataloader is None or keeps_own_position(dataloader):
        return
    raise ValueError(
        f"spin_dataloaders=False is Composer's setting for dataloaders that resume themselves, and this "
        f"{type(dataloader).__name__} does not (it has no state_dict()/load_state_dict()): Composer would restart a "
        "resumed epoch from its first batch, training those samples again. Here a resume continues at the first "
        "unseen batch of the same order; remove spin_dataloaders=False (True is what happens)."
    )


def check_dist_timeout(dist_timeout: object, fabric_given: bool) -> float | None:
    """``dist_timeout``: None, or a positive number of seconds (not with a ready ``fabric=``)."""
    if dist_timeout is None:
        return None
    if isinstance(dist_timeout, bool) or not isinstance(dist_timeout, (int, float)) or not dist_timeout > 0:
        raise ValueError(f"dist_timeout={dist_timeout!r} is not valid. Accepted: a positive number of seconds.")
    if fabric_given:
        raise ValueError(
            "Pass either fabric= or dist_timeout=, not both: that Fabric's strategy already has its timeout "
            "(DDPStrategy(timeout=...), FSDPStrategy(timeout=...))."
        )
    return float(dist_timeout)


def apply_dist_timeout(fabric: Fabric, dist_timeout: float) -> None:
    """``dist_timeout`` (seconds, checked) as the strategy's process-group and collective timeout, set before the
    launch."""
    from fabric.strategies.parallel import DEFAULT_TIMEOUT, ParallelStrategy

    strategy = fabric.strategy
    if not isinstance(strategy, ParallelStrategy):
        return  # one process: no process group to wait for
    timeout = timedelta(seconds=dist_timeout)
    if strategy.timeout not in (DEFAULT_TIMEOUT, timeout):
        raise ValueError(
            f"dist_timeout={dist_timeout!r} disagrees with the strategy object's timeout={strategy.timeout}; "
            "pass only one of them."
        )
    # The strategy reads it when it joins the process group, at launch, which comes after this.
    strategy.process_group_options = replace(strategy.process_group_options, timeout=timeout)


def check_compile_config(compile_config: object, model: nn.Module) -> dict[str, Any] | None:
    """``compile_config``: None (no compile) or ``torch.compile``'s keyword arguments (``{}``: its defaults)."""
    if compile_config is None:
        return None
    if not isinstance(compile_config, Mapping):
        raise ValueError(
            f"compile_config={compile_config!r} is not valid. Accepted: None, or a dict of torch.compile arguments "
            "({} compiles with its defaults)."
        )
    if uncompiled(model)[1] is not None:
        raise ValueError(
            "compile_config= was given with a model torch.compile already compiled; pass the plain model, or leave "
            "compile_config out (the compiled model keeps its settings)."
        )
    return dict(compile_config)


def console_loggers(
    log_to_console: object,
    console_log_interval: IntervalInput,
    console_stream: object,
    loggers: list[Any],
    progress_bar: bool,
) -> list[Any]:
    """``loggers`` with the ``ConsoleLogger`` that ``log_to_console=True`` adds (unless one is among them)."""
    from fabric.trainer.loggers.console import ConsoleLogger

    check_flag(log_to_console, "log_to_console")
    create_interval(console_log_interval, name="console_log_interval")  # a bad interval fails here either way
    stream = _console_stream(console_stream)
    if not log_to_console or any(isinstance(logger, ConsoleLogger) for logger in loggers):
        return loggers
    if progress_bar:
        rank_zero_warn(
            "Setting both progress_bar and log_to_console to True is not recommended: both print, and their "
            "lines interleave. Set one of them to False."
        )
    console: ConsoleLogger = ConsoleLogger(log_interval=console_log_interval, stream=stream)
    return [*loggers, console]


def _console_stream(stream: object) -> TextIO | None:
    if stream == "stdout":
        return None  # ConsoleLogger then prints to sys.stdout as it is at the time of printing
    if stream == "stderr":
        return sys.stderr
    if hasattr(stream, "write") and not isinstance(stream, str):
        return cast(TextIO, stream)  # anything with write() is taken for a text stream
    raise ValueError(f"console_stream={stream!r} is not valid. Accepted: 'stdout', 'stderr' or a text stream.")


def strict_model_weights(load_strict: bool, load_strict_model_weights: object) -> bool:
    """``load_strict_model_weights`` (Composer's name) or ``load_strict``; both given must agree."""
    if load_strict_model_weights is None:
        return load_strict
    strict = check_flag(load_strict_model_weights, "load_strict_model_weights")
    if not load_strict and strict:
        raise ValueError(
            "load_strict=False and load_strict_model_weights=True disagree: load_strict_model_weights is Composer's "
            "name for load_strict. Pass only one of them."
        )
    return strict


def check_exclude_algorithms(names: object) -> tuple[str, ...]:
    """``load_exclude_algorithms``: algorithm class names (``"BlurPool"``)."""
    if names is None:
        return ()
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise ValueError(
            f"load_exclude_algorithms={names!r} is not valid. Accepted: a list of algorithm class names, e.g. "
            "['BlurPool']."
        )
    checked = tuple(names)
    bad = [name for name in checked if not isinstance(name, str) or not name]
    if bad:
        raise ValueError(f"load_exclude_algorithms holds {bad}; every entry must be an algorithm class name.")
    return checked


def without_excluded(records: Sequence[Mapping[str, Any]], excluded: Sequence[str]) -> list[Mapping[str, Any]]:
    """The surgery records of a checkpoint, less those of the algorithm classes named in ``excluded``."""
    return [record for record in records if str(record["algorithm"]).rpartition(".")[2] not in excluded]


def algorithm_passes(passes: object) -> list[AlgorithmPass]:
    """The default passes with Composer's ``algorithm_passes`` added: a function is appended, ``(function, index)``
    inserted at ``index`` (``-1``: appended), in the order given."""
    merged = list(DEFAULT_PASSES)
    if passes is None:
        return merged
    given = [passes] if callable(passes) or isinstance(passes, tuple) else passes
    if not isinstance(given, Iterable):
        raise ValueError(_passes_error(passes))
    for entry in given:
        function, index = entry if isinstance(entry, tuple) and len(entry) == 2 else (entry, -1)
        if not callable(function) or isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(_passes_error(entry))
        if index == -1:
            merged.append(function)
        else:
            merged.insert(index, function)
    return merged


def _passes_error(value: object) -> str:
    return (
        f"algorithm_passes has {value!r}. Accepted: a function (algorithms, event) -> list of algorithms, a "
        "(function, index) pair, or a list of those."
    )
