"""Composer's checkpoint key paths on the Trainer's checkpoints: ``save_ignore_keys``, ``save_metrics`` and the
paths ``load_ignore_keys`` takes.

Composer names the parts of a checkpoint by ``/``-separated paths into its state dict (``"state/model/fc.weight"``,
``"state/optimizers"``, ``"rng"``) and matches them with shell globs (``fnmatch``: ``*`` also crosses ``/``); a
matched path goes with everything under it. The same paths name the parts of this Trainer's checkpoint:

* ``state/model`` (or ``state/model/*``): the ``model`` entry; ``state/model/<key glob>``: those keys of its state
  dict, when saving (one-file checkpoints only: not FSDP's ``state_dict_type="sharded"``, not DeepSpeed);
* ``state/optimizers``: every ``optimizer_<i>`` entry (whole);
* ``state/schedulers``, ``state/algorithms``, ``state/callbacks``, ``state/timestamp``: those sections of the
  trainer entry; ``state/dataset_state``: its ``dataloader`` section (the data position);
  ``state/device_train_microbatch_size``: its ``microbatch_size`` section;
* ``state/train_metrics``, ``state/eval_metrics``, ``state/metric_values``: the ``metrics`` entry's parts (saved only
  with ``save_metrics=True``);
* ``rng``: the ``rng`` entry;
* ``state/rank_zero_seed``, ``state/run_name``, ``state/integrations``, ``state/metadata``: not in these
  checkpoints; leaving them out removes nothing.

``load_ignore_keys`` also takes the plain part names (``"optimizers"``, ``"rng"``, ``"timestamp"``, ...: :data:`PARTS`).
A path reaching inside a part kept whole (``"state/optimizers/Adam/state"``) or ``state/scaler`` (the loss scale,
which Fabric saves with the precision plugin) is refused by name. The parts a save left out are recorded in the
checkpoint's ``meta["ignored"]`` (``meta["metrics"]`` says whether a ``metrics`` entry was saved) and are not asked
for when it loads, so it loads, those parts keeping their current values, as in Composer. When loading,
``state/model/<key>`` paths are refused: a load takes every weight the checkpoint holds
(``load_strict_model_weights=False`` loads a checkpoint whose model lacks some).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import Future
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from fabric.plugins.io.checkpoint_io import StorageOptions
from fabric.trainer.checkpoint.checkpointer import (
    CHECKPOINT_FORMAT,
    IGNORABLE,
    RngStates,
    TrainerCheckpointer,
    check_format,
    read_meta,
)
from fabric.trainer.checkpoint.trainer_state import SECTIONS, TrainerCheckpointState, from_blob, to_blob
from fabric.trainer.core.state import State, require_fabric
from fabric.trainer.surgery import surgery_records

#: Composer's path for each part of this Trainer's checkpoint (other than the model's keys).
COMPOSER_PATHS: dict[str, str] = {
    "rng": "rng",
    "state/model": "model",
    "state/optimizers": "optimizers",
    "state/schedulers": "schedulers",
    "state/algorithms": "algorithms",
    "state/callbacks": "callbacks",
    "state/timestamp": "timestamp",
    "state/dataset_state": "dataloader",
    "state/device_train_microbatch_size": "microbatch_size",
    "state/train_metrics": "train_metrics",
    "state/eval_metrics": "eval_metrics",
    "state/metric_values": "metric_values",
}
#: Parts kept only with ``save_metrics=True``.
METRIC_PARTS = ("train_metrics", "eval_metrics", "metric_values")
#: Every part's plain name: what ``load_ignore_keys`` takes besides Composer's paths.
PARTS = ("model", *IGNORABLE, *METRIC_PARTS)
#: Composer state keys these checkpoints do not have.
ABSENT = ("state/rank_zero_seed", "state/run_name", "state/integrations", "state/metadata")
_REFUSED = {
    "state/scaler": "the loss scale of precision='16-mixed' is saved by Fabric with the precision plugin, always",
}


def check_ignore_paths(paths: object, name: str) -> tuple[str, ...]:
    """``paths`` as a tuple of Composer path globs (or plain part names; ``None``, Composer's default, is none);
    ``ValueError`` naming what is refused."""
    if paths is None:
        return ()
    if isinstance(paths, str) or not isinstance(paths, Iterable) or callable(paths):
        raise ValueError(
            f"{name}={paths!r} is not valid. Accepted: a list of Composer paths such as ['state/optimizers', 'rng', "
            "'state/model/fc.*'] (a function editing the state dict is not supported)."
        )
    checked = tuple(paths)
    for path in checked:
        if not isinstance(path, str) or not path:
            raise ValueError(f"{name} holds {path!r}; every entry must be a non-empty path string.")
        for refused, reason in _REFUSED.items():
            if path == refused or path.startswith(f"{refused}/"):
                raise ValueError(f"{name} entry {path!r} is not supported: {reason}.")
        inside = [part for part in COMPOSER_PATHS if part != "state/model" and path.startswith(f"{part}/")]
        if inside and path != f"{inside[0]}/*":
            raise ValueError(
                f"{name} entry {path!r} reaches inside {inside[0]!r}, which is saved and loaded whole here. "
                f"Use {inside[0]!r} to leave all of it out."
            )
    return checked


def matched_parts(paths: Sequence[str]) -> set[str]:
    """The parts (plain names) that ``paths`` leave out whole: a plain name, or a glob matching a part's path, its
    parent, or everything under it (``"state/model/*"`` is the whole model)."""
    parts: set[str] = set()
    for path in paths:
        if path in PARTS:
            parts.add(path)
            continue
        for composer, part in COMPOSER_PATHS.items():
            if fnmatch.fnmatchcase(composer, path) or _is_ancestor_glob(path, composer):
                parts.add(part)
    return parts


def _is_ancestor_glob(path: str, composer: str) -> bool:
    """Whether ``path`` is ``<composer>/*`` (all of its children) or matches an ancestor of ``composer``."""
    if path == f"{composer}/*":
        return True
    pieces = composer.split("/")
    return any(fnmatch.fnmatchcase("/".join(pieces[:depth]), path) for depth in range(1, len(pieces)))


def model_keys_left_out(paths: Sequence[str]) -> Callable[[str], bool]:
    """Whether a key of the model's state dict is matched by ``paths`` as ``state/model/<key>``."""
    patterns = [path for path in paths if path not in PARTS]

    def left_out(key: str) -> bool:
        return any(fnmatch.fnmatchcase(f"state/model/{key}", pattern) for pattern in patterns)

    return left_out


def check_load_ignore_keys(ignore_keys: object) -> tuple[str, ...]:
    """``load_ignore_keys`` (the Trainer's, or ``load_checkpoint(ignore_keys=)``) as a tuple of part names and Composer
    paths, each naming a part of a checkpoint; ``ValueError`` naming what is refused."""
    paths = check_ignore_paths(ignore_keys, "load_ignore_keys")
    unknown = [path for path in paths if path not in PARTS and not _names_something(path)]
    if unknown:
        raise ValueError(
            f"load_ignore_keys has {unknown}, which name no part of a checkpoint. Accepted: {list(PARTS)} or "
            f"Composer's paths {list(COMPOSER_PATHS)} (globs allowed)."
        )
    model_keys = [path for path in paths if path.startswith("state/model/") and path != "state/model/*"]
    if model_keys:
        raise ValueError(
            f"load_ignore_keys {model_keys} would skip single weights of the model, which a load cannot do here: "
            "every weight the checkpoint holds is loaded. Skip the whole model with 'state/model', or load a "
            "checkpoint that lacks some weights with load_strict_model_weights=False."
        )
    return paths


def load_parts(ignore_keys: object) -> set[str]:
    """The parts ``load_ignore_keys`` skips (checked by :func:`check_load_ignore_keys`): plain names as they are,
    Composer paths translated."""
    return matched_parts(check_load_ignore_keys(ignore_keys))


def _names_something(path: str) -> bool:
    return bool(matched_parts([path])) or path in ABSENT or path.startswith("state/model/")


def _model_keys(model: nn.Module) -> list[str]:
    """The keys of the model's state dict (its parameters and buffers), without gathering a sharded model."""
    module = getattr(model, "module", model)
    return [name for name, _ in (*module.named_parameters(), *module.named_buffers())]


class MetricStates:
    """The ``metrics`` entry of ``save_metrics=True``: the train and eval metric objects' states and the latest
    computed values (``state.metrics``), each a serialized blob (any world size loads it, also sharded)."""

    def __init__(self, state: State, parts: Collection[str]) -> None:
        self.state = state
        self.parts = frozenset(parts)

    def state_dict(self) -> dict[str, Any]:
        state, saved = self.state, {}
        if "train_metrics" in self.parts:
            saved["train_metrics"] = to_blob({name: _metric_state(m) for name, m in state.train_metrics.items()})
        if "eval_metrics" in self.parts:
            saved["eval_metrics"] = to_blob(
                {
                    label: {name: _metric_state(m) for name, m in metrics.items()}
                    for label, metrics in state.eval_metrics.items()
                }
            )
        if "metric_values" in self.parts:
            saved["metric_values"] = to_blob({name: float(value) for name, value in state.metrics.items()})
        return saved

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state = self.state
        if "train_metrics" in self.parts and "train_metrics" in state_dict:
            _load_metrics(state.train_metrics, from_blob(state_dict["train_metrics"], "the metrics entry"))
        if "eval_metrics" in self.parts and "eval_metrics" in state_dict:
            for label, saved in from_blob(state_dict["eval_metrics"], "the metrics entry").items():
                _load_metrics(state.eval_metrics.get(label, {}), saved)
        if "metric_values" in self.parts and "metric_values" in state_dict:
            state.metrics.update(from_blob(state_dict["metric_values"], "the metrics entry"))


def _metric_state(metric: object) -> dict[str, Any] | None:
    """A metric's accumulated state: a torchmetrics ``metric_state`` (every state, persistent or not), another
    object's ``state_dict()``, or None for objects without one (the Trainer's averages of plain callables)."""
    states = getattr(metric, "metric_state", None)
    if isinstance(states, Mapping):
        return {name: _to_cpu(value) for name, value in states.items()}
    state_dict = getattr(metric, "state_dict", None)
    return {name: _to_cpu(value) for name, value in state_dict().items()} if callable(state_dict) else None


def _load_metrics(metrics: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
    for name, values in saved.items():
        metric = metrics.get(name)
        if metric is None or values is None:
            continue
        if isinstance(getattr(metric, "metric_state", None), Mapping):
            device = getattr(metric, "device", None)
            for state_name, value in values.items():
                setattr(metric, state_name, _to_device(value, device))
        elif callable(getattr(metric, "load_state_dict", None)):
            metric.load_state_dict(values)


def _to_cpu(value: object) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, list):
        return [_to_cpu(item) for item in value]
    return value


def _to_device(value: object, device: torch.device | None) -> Any:
    if isinstance(value, torch.Tensor) and device is not None:
        return value.to(device)
    if isinstance(value, list):
        return [_to_device(item, device) for item in value]
    return value


class _Sections:
    """The trainer entry without some of its sections (on save, and as the structure a sharded load fills)."""

    def __init__(self, trainer_state: TrainerCheckpointState, left_out: Collection[str]) -> None:
        self.trainer_state, self.left_out = trainer_state, frozenset(left_out)

    def state_dict(self) -> dict[str, Any]:
        return {key: value for key, value in self.trainer_state.state_dict().items() if key not in self.left_out}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.trainer_state.load_state_dict(state_dict)


class SelectiveCheckpointer(TrainerCheckpointer):
    """:class:`TrainerCheckpointer` that leaves out the parts ``save_ignore_keys`` names, saves the metrics with
    ``save_metrics=True``, and takes Composer's paths in ``load_ignore_keys``.

    The Trainer builds it from its plan (:mod:`fabric.trainer.plan`), which checked ``save_ignore_keys``
    (:func:`check_ignore_paths`) and ``save_metrics``; they are not checked again here.
    """

    def __init__(
        self,
        state: State,
        trainer_state: TrainerCheckpointState,
        run_name: str,
        storage_options: StorageOptions = None,
        *,
        save_ignore_keys: Sequence[str] = (),
        save_metrics: bool = False,
    ) -> None:
        super().__init__(state, trainer_state, run_name, storage_options)
        self.save_ignore_keys = tuple(save_ignore_keys)
        self.save_metrics = save_metrics
        self.left_out = matched_parts(self.save_ignore_keys)
        if not save_metrics:
            self.left_out |= set(METRIC_PARTS)
        left_out_key = model_keys_left_out(self.save_ignore_keys)
        #: Keeps a key of the model's state dict (None: every key is kept, no filter is needed).
        self._keeps_model_key: Callable[[str, Any], bool] | None = None
        if "model" not in self.left_out and any(left_out_key(key) for key in _model_keys(state.model)):
            self._keeps_model_key = lambda key, _: not left_out_key(key)
        self._check_strategy()

    def _check_strategy(self) -> None:
        """Refuse, when the Trainer is built, what this strategy's checkpoints cannot leave out."""
        strategy = require_fabric(self.state).strategy
        if self._keeps_model_key is not None and strategy.saves_on_every_rank:
            raise ValueError(
                f"save_ignore_keys={list(self.save_ignore_keys)} leaves single weights out of the model, which "
                f"{type(strategy).__name__}'s sharded checkpoints cannot do. Use FSDPStrategy(state_dict_type="
                "'full') (parallelism_config={'fsdp': {'state_dict_type': 'full'}}) or leave out 'state/model'."
            )
        if strategy.engine_handles_gradients and self.left_out & {"model", "optimizers"}:
            raise ValueError(
                f"save_ignore_keys={list(self.save_ignore_keys)} leaves the model or the optimizers out, but DeepSpeed "
                "saves them together in its engine's checkpoint. Leave them in."
            )

    @override
    def save(
        self,
        path: str,
        weights_only: bool = False,
        storage_options: StorageOptions = None,
        async_save: bool = False,
    ) -> Future[None]:
        fabric = require_fabric(self.state)
        left_out = self.left_out
        options: dict[str, Any] = {
            "storage_options": storage_options if storage_options is not None else self.storage_options,
            "async_save": async_save,
            "filter": None if self._keeps_model_key is None else {"model": self._keeps_model_key},
        }
        meta = {
            "format": CHECKPOINT_FORMAT,
            "world_size": fabric.world_size,
            "run_name": self.run_name,
            "surgery": surgery_records(self.state.algorithms),
            "ignored": sorted(left_out),
            "metrics": not weights_only and not set(METRIC_PARTS) <= left_out,  # whether a metrics entry follows
        }
        model = {} if "model" in left_out else {"model": self.state.model}
        if weights_only:
            with ExitStack() as exports:
                for algorithm in self.state.algorithms:
                    exports.enter_context(algorithm.exported_weights(self.state))
                written: Future[None] = fabric.save(path, {**model, "meta": meta}, **options)
            return written
        entries: dict[str, Any] = {**model, **({} if "optimizers" in left_out else self._optimizers())}
        entries["trainer"] = _Sections(self.trainer_state, left_out)
        if "rng" not in left_out:
            entries["rng"] = RngStates(fabric)
        if not set(METRIC_PARTS) <= left_out:
            entries["metrics"] = MetricStates(self.state, set(METRIC_PARTS) - left_out)
        entries["meta"] = meta
        written = fabric.save(path, entries, **options)
        return written

    @override
    def load(
        self, path: str, *, weights_only: bool = False, strict: bool = True, ignore_keys: Collection[str] = ()
    ) -> None:
        """Restore from ``path``, skipping ``ignore_keys`` (part names or Composer paths, checked here) and the parts
        the save left out; on any error nothing changed."""
        self.load_skipping(path, load_parts(ignore_keys), weights_only=weights_only, strict=strict)

    def load_skipping(self, path: str, parts: Collection[str], *, weights_only: bool, strict: bool) -> None:
        """:meth:`load` skipping ``parts`` (plain part names: ignore keys already checked, by the plan for the
        Trainer's ``load_ignore_keys``, and translated by :func:`matched_parts`)."""
        skipped = set(parts)
        fabric = require_fabric(self.state)
        meta = read_meta(path, fabric.strategy.checkpoint_io, self.storage_options)
        check_format(meta, path)
        skipped |= {part for part in meta.get("ignored", ()) if part in PARTS}  # (a sharded save drops an empty list)
        entries: dict[str, Any] = {} if "model" in skipped else {"model": self.state.model}
        if not weights_only:
            if "optimizers" not in skipped:
                entries.update(self._optimizers())
            sections = skipped & set(SECTIONS)
            self.trainer_state.ignore = frozenset(sections)
            entries["trainer"] = _Sections(self.trainer_state, sections)
            if "rng" not in skipped:
                entries["rng"] = RngStates(fabric)
            metric_parts = set(METRIC_PARTS) - skipped
            if metric_parts and meta.get("metrics"):
                entries["metrics"] = MetricStates(self.state, metric_parts)
        if entries:
            fabric.load(path, entries, strict=strict, storage_options=self.storage_options)
        rng = entries.get("rng")
        if isinstance(rng, RngStates) and rng.loaded is not None:
            self._restore_rng(rng.loaded)
