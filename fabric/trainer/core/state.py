"""``State``: everything the training loop knows, in one place, under the names algorithms expect.

Algorithms and callbacks receive the State at every event and may read or change it: swap the batch
before the forward, scale the loss, stop training. Names follow Composer (``model``, ``optimizers``,
``batch``, ``outputs``, ``loss``, ``timestamp``, ``max_duration``, ...).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.optim import Optimizer

from fabric.trainer.core.time import Time, Timestamp, TimeUnit, elapsed_fraction, reached

if TYPE_CHECKING:
    from fabric.fabric import Fabric
    from fabric.trainer.devices import Device

#: Attributes of Composer's ``State`` that this one does not have: asking for one says so in one line (programs
#: written for Composer reach for them, llm-foundry's callbacks first), rather than a bare ``AttributeError``.
COMPOSER_ONLY = frozenset(
    {
        "auto_microbatching", "automicrobatch_fsdp_hook_handles", "batch_get_item", "batch_set_item",
        "dataset_resumption", "dataset_state", "device_mesh", "evaluators", "fsdp_config",
        "fsdp_config_version", "fsdp_modules", "fsdp_sharded_state_dict_enabled", "fsdp_state_dict_type",
        "get_model_state_dict", "get_optim_state_dict", "load_model_state", "load_monolith_rank", "load_optim_state",
        "load_path", "load_state_dict", "precision", "precision_config", "previous_timestamp",
        "profiler", "rank_zero_seed", "save_metrics", "scaler", "seed", "serialized_attributes", "set_dataloader",
        "state_dict", "total_loss_dict", "tp_config", "train_dataloader",
    }
)  # fmt: skip


def loader_length(loader: Iterable[Any]) -> int | None:
    """Batches per epoch of ``loader``, or None when it has no length (e.g. over an ``IterableDataset``).

    A ``DataLoader`` always has ``__len__``, which raises ``TypeError`` when its dataset has no length.
    """
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None


@dataclass
class State:
    """The mutable training state shared by the loop, algorithms and callbacks."""

    model: nn.Module
    #: How long to train; None until given (to the Trainer or to ``fit(duration=...)``).
    max_duration: Time[Any] | None = None
    optimizers: list[Optimizer] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    timestamp: Timestamp = field(default_factory=Timestamp)
    #: The current batch (train, eval or predict) and what the model made of it.
    batch: Any = None
    outputs: Any = None
    loss: Any = None
    dataloader: Iterable[Any] | None = None
    #: Batches per epoch of ``dataloader``, when it has a length.
    dataloader_len: int | None = None
    #: The latest value of every metric, by name (``"eval/accuracy"``).
    metrics: dict[str, Any] = field(default_factory=dict)
    algorithms: list[Any] = field(default_factory=list)
    callbacks: list[Any] = field(default_factory=list)
    #: The Fabric the trainer runs on: ``state.fabric.world_size``, ``.device``, ``.all_reduce`` for callbacks;
    #: None in a State made outside a Trainer (see :func:`require_fabric`).
    fabric: Fabric | None = None
    #: The run's name (the Trainer's ``run_name``, the same on every rank): loggers name their runs after it.
    run_name: str | None = None
    #: Samples per forward/backward pass; None trains each batch in one pass.
    device_train_microbatch_size: int | None = None
    #: Samples per eval forward of the evaluator running now; None runs each batch in one forward.
    device_eval_microbatch_size: int | None = None
    #: Metric objects by name (torchmetrics ``Metric`` or callables), updated during training.
    train_metrics: dict[str, Any] = field(default_factory=dict)
    #: Metric objects per evaluator label (``"eval"``), then by name.
    eval_metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Composer's: the value each training metric computed last, by the metric's name (no label).
    train_metric_values: dict[str, Any] = field(default_factory=dict)
    #: Composer's: the value each evaluation metric computed last, by the metric's name (no label: the evaluator run
    #: last wins, as in Composer; ``metrics`` keeps them by label).
    eval_metric_values: dict[str, Any] = field(default_factory=dict)
    #: Composer's: what the model's ``update_metric`` returned for the current evaluation batch (per-sample results
    #: of llm-foundry's in-context learning metrics), ``{}`` when it returned nothing.
    metric_outputs: dict[str, Any] = field(default_factory=dict)
    #: Progress within the current evaluation or predict round (reset per dataloader).
    eval_timestamp: Timestamp = field(default_factory=Timestamp)
    predict_timestamp: Timestamp = field(default_factory=Timestamp)
    #: The label of the evaluator being run (``"eval"`` by default), None outside evaluation.
    dataloader_label: str | None = None
    #: Batches the running evaluation will take, when known (its dataloader's length, or its subset).
    eval_batches: int | None = None

    def __post_init__(self) -> None:
        if self.max_duration is not None and self.max_duration.unit == TimeUnit.DURATION:
            raise ValueError(f"max_duration={self.max_duration} cannot be in 'dur': it is what 'dur' is a fraction of.")

    def get_elapsed_duration(self) -> Time[float]:
        """How far through ``max_duration`` training is, as a Time in ``dur`` (``1.0dur`` at the end).

        As in Composer it compares with plain numbers (``state.get_elapsed_duration() >= 0.5``); ``float()``
        gives the number. An epoch ``max_duration`` is counted in batches through ``dataloader_len``, so the
        fraction moves every batch; only a train dataloader without a length leaves it moving once per epoch.
        """
        if self.max_duration is None:
            raise ValueError("The elapsed duration is unknown: max_duration is not set.")
        return Time(elapsed_fraction(self.timestamp, self.max_duration, self.dataloader_len), TimeUnit.DURATION)

    def stop_training(self) -> None:
        """End training after the current batch: ``max_duration`` becomes the current batch count."""
        self.max_duration = Time.from_batch(int(self.timestamp.batch))

    @property
    def finished(self) -> bool:
        """Whether ``max_duration`` has been reached."""
        return self.max_duration is not None and reached(self.timestamp, self.max_duration)

    @property
    def is_model_ddp(self) -> bool:
        """Whether ``state.model`` wraps the user's model, which is then ``state.model.module`` (Composer's name, for
        its idiom ``state.model.module if state.is_model_ddp else state.model``). Composer wraps only for DDP; here
        the Trainer's Fabric wraps the model on every strategy once it is set up (not yet at ``INIT``), so this is
        ``True`` from then on, one process included: the idiom finds the user's model either way."""
        from fabric.wrappers import FabricModule

        return isinstance(self.model, FabricModule)

    @property
    def fsdp_enabled(self) -> bool:
        """Whether the model is sharded with FSDP (Composer's name)."""
        from fabric.strategies.fsdp.strategy import FSDPStrategy

        return self.fabric is not None and isinstance(self.fabric.strategy, FSDPStrategy)

    @property
    def device(self) -> Device:
        """This process's device as Composer's ``Device`` object (``state.device.tensor_to_device(...)``)."""
        from fabric.trainer.devices import DeviceCPU, DeviceGPU, DeviceMPS

        device = require_fabric(self).device
        if device.type == "cuda":
            return DeviceGPU(device.index)
        return DeviceMPS() if device.type == "mps" else DeviceCPU()

    def __getattr__(self, name: str) -> Any:
        if name in COMPOSER_ONLY:
            raise AttributeError(
                f"state.{name} is an attribute of Composer's State that this Trainer's State does not have "
                "(docs/coming-from-composer.md lists what it has)."
            )
        raise AttributeError(f"'State' object has no attribute {name!r}")


def require_fabric(state: State) -> Fabric:
    """``state.fabric``, for the code that runs only under a Trainer (which always sets it); callbacks that also work
    on a bare State check ``state.fabric is None`` themselves. A function rather than a method, so that stand-ins
    for a State (a ``SimpleNamespace`` in a test) need no more than ``fabric``."""
    if state.fabric is None:
        raise RuntimeError(
            "This needs the Trainer's Fabric, and state.fabric is None (a State made outside a Trainer)."
        )
    return state.fabric
