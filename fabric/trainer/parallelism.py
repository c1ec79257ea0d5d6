"""Composer's ``parallelism_config={"fsdp": {...}, "tp": {...}}`` as this project's strategies:
:class:`~fabric.strategies.fsdp.FSDPStrategy`, or with a ``"tp"`` section
:class:`~fabric.strategies.model_parallel.ModelParallelStrategy` applying its ``layer_plan``; the mesh is a
:class:`~fabric.strategies.mesh.MeshPlan` of the degrees.

Each key of Composer's FSDP section (``FSDPConfig``) is mapped onto an ``FSDPStrategy`` argument, accepted where it
changes nothing here, or refused with a ``ValueError`` naming the key, its value and what to use instead:

=====================================  ==========================================================================
Composer ``fsdp`` key                  FSDPStrategy
=====================================  ==========================================================================
``sharding_strategy``                  ``sharding_strategy`` (``FULL_SHARD``, ``SHARD_GRAD_OP``, ``HYBRID_SHARD``,
                                       ``_HYBRID_SHARD_ZERO2``, ``NO_SHARD``)
``state_dict_type``                    ``"full"`` (Composer's default, also here when the key is absent) or
                                       ``"sharded"``; ``"local"`` refused
``auto_wrap`` (default ``True``)       ``shard_modules``: the modules whose ``_fsdp_wrap`` attribute is true, else
                                       those the model's (or a top-level child's) ``fsdp_wrap_fn(module)`` picks;
                                       ``False``: the root is the only unit. A ``fsdp_wrap_fn`` returning a dict of
                                       per-module FSDP arguments is refused.
``activation_checkpointing``           ``activation_checkpointing``: the classes of the modules whose
                                       ``_activation_checkpointing`` attribute is true, else those the model's
                                       ``activation_checkpointing_fn(module)`` picks; refused when it picks only
                                       some instances of a class (FSDPStrategy recomputes whole classes)
``activation_checkpointing_reentrant`` accepted: the recomputation here is non-reentrant (the same gradients)
``cpu_offload``                        ``cpu_offload``
``mixed_precision``                    ``"FULL"`` or a dict of ``param_dtype``/``reduce_dtype`` (``"fp32"``,
                                       ``"bf16"``, ``"fp16"``, ...) -> ``MixedPrecisionPolicy``; ``"DEFAULT"``,
                                       ``"PURE"`` and ``buffer_dtype`` refused (FSDP2 does not cast buffers)
``sync_module_states``                 ``sync_module_states``
``reshard_after_forward``              ``reshard_after_forward`` (Composer's FSDP2 key)
``use_orig_params``, ``limit_all_...`` ``True`` accepted (always so in FSDP2); ``False`` refused
``verbose``                            accepted: ``True`` prints the strategy built
``backward_prefetch``                  ``"BACKWARD_PRE"`` accepted (FSDP2 prefetches so); others refused
``data_parallel_shard_degree``,        ``MeshPlan(data_parallel_replicate=..., data_parallel=...)``: HSDP of any shape
``data_parallel_replicate_degree``     (``-1``/``None``: what the others leave; replicate ``None``: 1)
``forward_prefetch``, ``*_limit``,     their defaults accepted (``False``, ``1``, ``False``,
``keep_low_precision_grads``,          ``None``, ``"ep{epoch}-ba{batch}"``); anything else refused, naming the
                                       equivalent where one exists
``activation_cpu_offload``, ``te_*``,
``load_monolith_rank0_only``,
``ignored_modules``, ``process_group``,
``*_planner``, ``sharded_ckpt_...``
=====================================  ==========================================================================

The ``"tp"`` section (Composer's ``TPConfig``): ``tensor_parallel_degree`` is the mesh's ``tensor_parallel`` degree and
``layer_plan`` (``{"module.path": ParallelStyle}``, ``*`` matching one name) is applied with
``parallelize_module`` over ``mesh["tensor_parallel"]`` before FSDP shards; a plan key naming no submodule of the
model is refused. Without an ``"fsdp"`` section its defaults apply.

The ``"pp"`` section (this project's; Composer has none) cuts the model into pipeline stages: ``split_points``
(required), ``microbatches``, ``schedule``, ``network``, ``stage_forward`` and ``every_stage`` as in
:class:`~fabric.strategies.pipeline.PipelinePlan`, and ``pipeline_parallel_degree`` (default: one rank per stage; fewer
with a multi-stage schedule such as ``"Interleaved1F1B"``, each rank holding several stages) checked against the stages
they make; the loss is the model's (see :mod:`fabric.trainer.pipeline`), and checkpoints are sharded unless
``state_dict_type="full"`` is asked for (refused: no rank holds the whole model).

The ``"cp"`` section (this project's too) splits sequences over ``context_parallel_degree`` ranks (CUDA only):
``seq_dims`` names the batch entries that hold sequences (keys of a dict batch, positions of a tuple or list batch)
with their sequence dimension, ``buffers`` the model buffers (rotary tables) with theirs; the Trainer splits them
around each microbatch (:class:`SequenceSplit`, :mod:`fabric.strategies.context_parallel`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fabric.utilities.rank_zero import rank_zero_info

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from fabric.strategies.fsdp.strategy import FSDPStrategy
    from fabric.strategies.mesh import MeshPlan
    from fabric.strategies.pipeline import PipelinePlan

#: Composer dtype names (``get_torch_dtype``'s) for ``mixed_precision={...}``.
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "amp_fp16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "amp_bf16": torch.bfloat16,
}

#: Keys whose Composer default changes nothing here: accepted with that value, refused with another.
_DEFAULT_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "forward_prefetch": (
        (False,),
        "FSDP2 has no such flag; after setup call unit.set_modules_to_forward_prefetch([...]) on the sharded layers",
    ),
    "backward_prefetch": (
        ("BACKWARD_PRE", "backward_pre"),
        "FSDP2 always prefetches the next unit's all-gather in the backward as BACKWARD_PRE does",
    ),
    "backward_prefetch_limit": ((1,), "FSDP2 prefetches one unit ahead"),
    "forward_prefetch_limit": ((1,), "FSDP2 prefetches one unit ahead"),
    "keep_low_precision_grads": (
        (False,),
        "FSDP2 gives gradients the sharded parameters' dtype; train in low precision throughout with "
        "precision='bf16-true'",
    ),
    "activation_cpu_offload": ((False,), "activations cannot be offloaded to the CPU here"),
    "te_checkpoint_wrapper": ((False,), "TransformerEngine layers are not supported"),
    "te_shard_fp8_weight": ((False,), "TransformerEngine layers are not supported"),
    "load_monolith_rank0_only": (
        (False,),
        "every rank reads a full checkpoint here; use state_dict_type='sharded' to read only this rank's shards",
    ),
    "load_planner": ((None,), "torch.distributed.checkpoint planners are not exposed; the default planner is used"),
    "save_planner": ((None,), "torch.distributed.checkpoint planners are not exposed; the default planner is used"),
    "sharded_ckpt_prefix_dir": (
        ("ep{epoch}-ba{batch}",),
        "a sharded checkpoint is a directory named by save_filename",
    ),
    "ignored_modules": (
        (None,),
        "every parameter of the model is sharded; keep such modules out of the model given to the Trainer",
    ),
    "process_group": (
        (None,),
        "the process groups come from the device mesh built at launch; choose its layout with "
        "sharding_strategy='HYBRID_SHARD'",
    ),
    "device_mesh": (
        (None,),
        "the device mesh is built at launch (1-D, or 2-D with sharding_strategy='HYBRID_SHARD')",
    ),
}

_BOOLEAN_KEYS = (
    "auto_wrap",
    "activation_checkpointing",
    "activation_checkpointing_reentrant",
    "cpu_offload",
    "sync_module_states",
    "reshard_after_forward",
    "use_orig_params",
    "limit_all_gathers",
    "verbose",
)
_DEGREE_KEYS = ("data_parallel_shard_degree", "data_parallel_replicate_degree")
ACCEPTED = ("sharding_strategy", "state_dict_type", "mixed_precision", *_DEGREE_KEYS, *_BOOLEAN_KEYS, *_DEFAULT_ONLY)
TP_KEYS = ("tensor_parallel_degree", "layer_plan")


@dataclass(frozen=True)
class TPConfig:
    """Composer's ``TPConfig`` (``parallelism_config={"tp": TPConfig(...)}``, as llm-foundry builds it): the same
    as the ``"tp"`` dict with these keys."""

    tensor_parallel_degree: int = 1
    layer_plan: Mapping[str, Any] | None = None


def strategy_from(parallelism_config: object, model: nn.Module) -> FSDPStrategy | None:
    """The strategy Composer's ``parallelism_config`` describes for ``model``; None without fsdp, tp or pp
    sections."""
    if parallelism_config is None:
        return None
    if not isinstance(parallelism_config, Mapping):
        raise ValueError(
            f"parallelism_config={parallelism_config!r} is not valid. Accepted: a dict {{'fsdp': {{...}}, "
            "'tp': {...}, 'pp': {...}}} (Composer's FSDP and TP config keys, and pipeline stages) or None."
        )
    unknown = sorted(set(parallelism_config) - {"fsdp", "tp", "pp", "cp"})
    if unknown:
        raise ValueError(f"parallelism_config has {unknown}; accepted sections: 'fsdp', 'tp', 'pp', 'cp'.")
    fsdp, tp, pp, cp = (parallelism_config.get(name) for name in ("fsdp", "tp", "pp", "cp"))
    if isinstance(tp, TPConfig):
        tp = {"tensor_parallel_degree": tp.tensor_parallel_degree, "layer_plan": tp.layer_plan}
    if fsdp is None and tp is None and pp is None and cp is None:
        return None
    for name, section in (("fsdp", fsdp), ("tp", tp), ("pp", pp), ("cp", cp)):
        if section is not None and not isinstance(section, Mapping):
            raise ValueError(
                f"parallelism_config['{name}']={section!r} is not valid. Accepted: a dict of {name.upper()} keys."
            )
    tensor_parallel = None if tp is None else _tensor_parallel(dict(tp), model)
    pipeline, pipeline_degree = (None, 1) if pp is None else _pipeline(dict(pp))
    context_degree = 1 if cp is None else sequence_split_from(parallelism_config).degree  # type: ignore[union-attr]
    return _build(dict(fsdp or {}), model, tensor_parallel, pipeline, pipeline_degree, context_degree)


def _check_fsdp_keys(config: Mapping[str, Any]) -> None:
    """``parallelism_config['fsdp']``: keys FSDPStrategy takes, with values it can honour."""
    unknown = sorted(set(config) - set(ACCEPTED))
    if unknown:
        raise ValueError(
            f"parallelism_config['fsdp'] has {unknown}, which FSDPStrategy cannot take. "
            f"Accepted keys: {list(ACCEPTED)}."
        )
    for key in _BOOLEAN_KEYS:
        if key in config and not isinstance(config[key], bool):
            raise ValueError(
                f"parallelism_config['fsdp']['{key}']={config[key]!r} is not valid. Accepted: True or False."
            )
    for key, (accepted, instead) in _DEFAULT_ONLY.items():
        if key in config and config[key] not in accepted:
            raise ValueError(
                f"parallelism_config['fsdp']['{key}']={config[key]!r} is not supported: {instead}. "
                f"Accepted: {' or '.join(map(repr, accepted))} (or leave it out)."
            )
    for key in ("use_orig_params", "limit_all_gathers"):
        if config.get(key) is False:
            raise ValueError(
                f"parallelism_config['fsdp']['{key}']=False is not possible: FSDP2 always behaves as {key}=True. "
                "Remove it."
            )


def _build(
    config: dict[str, Any],
    model: nn.Module,
    tensor_parallel: TensorParallelPlan | None,
    pipeline: PipelinePlan | None,
    pipeline_degree: int,
    context_degree: int,
) -> FSDPStrategy:
    from fabric.strategies.fsdp.strategy import FSDPStrategy
    from fabric.strategies.model_parallel import ModelParallelStrategy

    _check_fsdp_keys(config)
    # no rank holds a pipeline's whole model: its checkpoints are sharded unless "full" is asked for (and refused)
    options: dict[str, Any] = {
        "state_dict_type": _state_dict_type(config.get("state_dict_type", "full" if pipeline is None else "sharded"))
    }
    # the sections that need ModelParallelStrategy, which takes the mesh only
    given = (("tp", tensor_parallel is not None), ("pp", pipeline is not None), ("cp", context_degree > 1))
    sections = [name for name, present in given if present]
    splits = bool(sections)
    degrees = {
        "tensor_parallel": 1 if tensor_parallel is None else tensor_parallel.degree,
        "pipeline_parallel": pipeline_degree,
        "context_parallel": context_degree,
    }
    mesh = _mesh_plan(config, degrees if splits else None)
    if "sharding_strategy" in config:
        options |= _sharding_options(config["sharding_strategy"], mesh, sections)
    if mesh is not None:
        options["mesh"] = mesh
    if config.get("auto_wrap", True):
        options["shard_modules"] = _wrap_predicate(model)  # None when nothing in the model asks for units
    if config.get("activation_checkpointing", False):
        options["activation_checkpointing"] = _checkpointed_classes(model)
    for key in ("cpu_offload", "sync_module_states", "reshard_after_forward"):
        if key in config:
            options[key] = config[key]
    if "mixed_precision" in config:
        options["mixed_precision"] = _mixed_precision(config["mixed_precision"])
    try:
        if not splits:
            strategy = FSDPStrategy(**options)
        else:
            strategy = ModelParallelStrategy(tensor_parallel, pipeline=pipeline, **options)
    except ValueError as error:
        raise ValueError(f"parallelism_config['fsdp']: {error}") from None
    if config.get("verbose", False):
        rank_zero_info(f"parallelism_config['fsdp'] -> {strategy!r}")
    return strategy


class TensorParallelPlan:
    """Composer's ``layer_plan`` as a ``parallelize_fn``: ``parallelize_module`` over ``mesh["tensor_parallel"]``."""

    def __init__(self, degree: int, layer_plan: Mapping[str, Any]) -> None:
        self.degree = degree
        self.layer_plan = dict(layer_plan)

    def __call__(self, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor.parallel import parallelize_module

        return parallelize_module(model, mesh["tensor_parallel"], self.layer_plan)

    def __repr__(self) -> str:
        return f"TensorParallelPlan(degree={self.degree}, layer_plan={sorted(self.layer_plan)})"


def _tensor_parallel(config: dict[str, Any], model: nn.Module) -> TensorParallelPlan:
    """The ``"tp"`` section, checked against ``model``: every plan key names a submodule, every value is a style."""
    from torch.distributed.tensor.parallel import ParallelStyle

    unknown = sorted(set(config) - set(TP_KEYS))
    if unknown:
        raise ValueError(f"parallelism_config['tp'] has {unknown}; accepted keys: {list(TP_KEYS)}.")
    degree = config.get("tensor_parallel_degree", 1)
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        raise ValueError(
            f"parallelism_config['tp']['tensor_parallel_degree']={degree!r} is not valid. Accepted: a positive int."
        )
    layer_plan = config.get("layer_plan")
    if not isinstance(layer_plan, Mapping) or not layer_plan:
        raise ValueError(
            f"parallelism_config['tp']['layer_plan']={layer_plan!r} is not valid: tensor parallelism needs a plan "
            "of the layers to split. Accepted: a dict {'module.path': ParallelStyle} (ColwiseParallel(), ...)."
        )
    names = [name for name, _ in model.named_modules() if name]
    for key, style in layer_plan.items():
        if not isinstance(style, ParallelStyle):
            raise ValueError(
                f"parallelism_config['tp']['layer_plan']['{key}']={style!r} is not valid. Accepted: a "
                "torch.distributed.tensor.parallel ParallelStyle (ColwiseParallel(), RowwiseParallel(), ...)."
            )
        if not any(_matches(name, key) for name in names):
            raise ValueError(
                f"parallelism_config['tp']['layer_plan'] names '{key}', which is no submodule of "
                f"{type(model).__name__} (its submodules: {', '.join(names[:8])}{', ...' if len(names) > 8 else ''})."
            )
    return TensorParallelPlan(degree, layer_plan)


def _matches(name: str, pattern: str) -> bool:
    """``parallelize_module``'s matching: the same number of dotted atoms, each equal or matched by ``*`` globs."""
    atoms, patterns = name.split("."), pattern.split(".")
    return len(atoms) == len(patterns) and all(fnmatch(atom, part) for atom, part in zip(atoms, patterns, strict=True))


CP_KEYS = ("context_parallel_degree", "seq_dims", "buffers")


@dataclass(frozen=True)
class SequenceSplit:
    """The ``"cp"`` section: the mesh's ``context_parallel`` degree, and what the Trainer splits along the sequence
    around each microbatch's forward and backward: the batch's entries (keys of a mapping batch, positions of a
    tuple or list batch) and the model's buffers (by name, e.g. rotary tables), each with its sequence dimension."""

    degree: int
    batch: Mapping[str | int, int]
    buffers: Mapping[str, int]

    def tensors(self, batch: Any, model: nn.Module) -> tuple[list[torch.Tensor], list[int]]:
        """The tensors to split in ``batch`` and ``model``, and their sequence dimensions."""
        tensors, dims = [], []
        for key, dim in self.batch.items():
            entry = _entry(batch, key)
            if not isinstance(entry, torch.Tensor):
                raise ValueError(
                    f"parallelism_config['cp']['seq_dims'] names the batch entry {key!r}, but this "
                    f"{type(batch).__name__} batch holds {type(entry).__name__} there; name entries that hold "
                    "sequence tensors (keys of a dict batch, positions of a tuple or list batch)."
                )
            tensors.append(entry)
            dims.append(dim)
        for name, dim in self.buffers.items():
            tensors.append(model.get_buffer(name))
            dims.append(dim)
        return tensors, dims


def _entry(batch: Any, key: str | int) -> Any:
    """``batch[key]``, or None where the batch has no such entry."""
    try:
        return batch[key]
    except (KeyError, IndexError, TypeError):
        return None


def sequence_split_from(parallelism_config: object) -> SequenceSplit | None:
    """The ``"cp"`` section of ``parallelism_config`` checked, or None without one."""
    section = parallelism_config.get("cp") if isinstance(parallelism_config, Mapping) else None
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ValueError(f"parallelism_config['cp']={section!r} is not valid. Accepted: a dict of CP keys.")
    unknown = sorted(set(section) - set(CP_KEYS))
    degree, seq_dims = section.get("context_parallel_degree"), section.get("seq_dims")
    buffers = section.get("buffers") or {}
    if unknown or not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        raise ValueError(
            f"parallelism_config['cp'] is not valid ({unknown or f'context_parallel_degree={degree!r}'}). Accepted "
            f"keys: {list(CP_KEYS)}, context_parallel_degree a positive int."
        )
    if not seq_dims:
        raise ValueError(
            "parallelism_config['cp'] needs seq_dims: the batch entries that hold sequences and their sequence "
            "dimension, e.g. {'input_ids': 1, 'labels': 1}."
        )
    for name, dims in (("seq_dims", seq_dims), ("buffers", buffers)):
        if not isinstance(dims, Mapping) or not all(isinstance(dim, int) and dim >= 0 for dim in dims.values()):
            raise ValueError(
                f"parallelism_config['cp']['{name}']={dims!r} is not valid. Accepted: a dict of "
                f"{'batch entries' if name == 'seq_dims' else 'buffer names'} to the dimension of their sequence, "
                "e.g. {'input_ids': 1, 'labels': 1}."
            )
    return SequenceSplit(degree, dict(seq_dims), dict(buffers))


PP_KEYS = (
    "pipeline_parallel_degree",
    "split_points",
    "microbatches",
    "schedule",
    "network",
    "stage_forward",
    "every_stage",
)


def _pipeline(config: dict[str, Any]) -> tuple[PipelinePlan, int]:
    """The ``"pp"`` section as a plan (the loss is the model's) and the pipeline degree: ``split_points`` and
    optionally the others of :data:`PP_KEYS`; a ``pipeline_parallel_degree`` must place the stages the split points
    make (as many, or a multiple with a multi-stage schedule); without one, one stage per rank (two in a V)."""
    from fabric.strategies.pipeline import PipelinePlan

    unknown = sorted(set(config) - set(PP_KEYS))
    if unknown or "split_points" not in config:
        raise ValueError(
            f"parallelism_config['pp'] has {unknown or 'no split_points'}; accepted keys: {list(PP_KEYS)} "
            "(split_points required)."
        )
    degree = config.pop("pipeline_parallel_degree", None)
    try:
        plan = PipelinePlan(**config)
        if degree is not None:
            plan.check_degree(degree)
    except (TypeError, ValueError) as error:
        raise ValueError(f"parallelism_config['pp']: {error}") from None
    return plan, plan.default_degree if degree is None else degree


def _mesh_plan(config: Mapping[str, Any], splits: Mapping[str, int] | None) -> MeshPlan | None:
    """The degrees as a plan (``splits``: the tensor, pipeline and context degrees, None without a tp, pp or cp
    section); None when neither a data-parallel degree nor a section is given (the mesh follows
    ``sharding_strategy``)."""
    from fabric.strategies.mesh import AUTO, MeshPlan

    shard = config.get("data_parallel_shard_degree")
    replicate = config.get("data_parallel_replicate_degree")
    if shard in (None, -1) and replicate in (None, 1) and splits is None:
        return None
    for key, value in (("data_parallel_shard_degree", shard), ("data_parallel_replicate_degree", replicate)):
        if value is not None and value != -1 and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(
                f"parallelism_config['fsdp']['{key}']={value!r} is not valid. Accepted: a positive int, -1 (what "
                "the other degrees leave of the world) or None."
            )
    try:
        return MeshPlan(
            data_parallel_replicate=AUTO if replicate == -1 else replicate or 1,
            data_parallel=AUTO if shard in (None, -1) else shard,
            **(splits or {}),
        )
    except ValueError as error:
        raise ValueError(f"parallelism_config: {error}") from None


def _sharding_options(value: object, mesh: MeshPlan | None, sections: list[str]) -> dict[str, Any]:
    """``sharding_strategy`` as FSDPStrategy takes it; with tensor, pipeline or context parallelism (``sections``
    given: ModelParallelStrategy, which takes the mesh only) as ``reshard_after_forward``, the mesh saying what is
    replicated."""
    if not sections:
        return {"sharding_strategy": value}
    from fabric.strategies.fsdp.options import SHARDING_STRATEGIES, sharding_strategy_name

    try:
        name = sharding_strategy_name(value)
    except ValueError as error:
        raise ValueError(f"parallelism_config['fsdp']: {error}") from None
    reshard, hybrid, replicate_only = SHARDING_STRATEGIES[name]
    assert mesh is not None  # tensor and pipeline parallelism always have a plan
    if (hybrid and mesh.data_parallel_replicate == 1) or (replicate_only and mesh.data_parallel != 1):
        raise ValueError(
            f"parallelism_config['fsdp']['sharding_strategy']={value!r} with a {' and '.join(map(repr, sections))} "
            "section needs the degrees that "
            f"say what is replicated: data_parallel_replicate_degree{' > 1' if hybrid else ''} "
            f"{'and data_parallel_shard_degree' if hybrid else '=-1 and data_parallel_shard_degree=1'}."
        )
    return {"reshard_after_forward": reshard}


def _state_dict_type(value: object) -> str:
    if value in ("full", "sharded"):
        return str(value)
    if value == "local":
        raise ValueError(
            "parallelism_config['fsdp']['state_dict_type']='local' is not supported: FSDP2 has no local (flat "
            "parameter) state dict. Use 'sharded' (a directory of per-rank shards, any world size loads it)."
        )
    raise ValueError(
        f"parallelism_config['fsdp']['state_dict_type']={value!r} is not valid. Accepted: 'full', 'sharded'."
    )


def _owners(model: nn.Module, method: str) -> list[tuple[Callable[[nn.Module], Any], set[int]]]:
    """The model's ``method`` and its top-level children's, each with the ids of the modules it decides for."""
    found = []
    for owner in (model, *model.children()):
        function = getattr(owner, method, None)
        if callable(function):
            found.append((function, {id(module) for module in owner.modules()}))
    return found


def _choice(module: nn.Module, attribute: str, owners: list[tuple[Callable[[nn.Module], Any], set[int]]]) -> Any:
    """Composer's decision for ``module``: its own ``attribute`` first, else the first owner's function."""
    if hasattr(module, attribute):
        return bool(getattr(module, attribute))
    for function, decides_for in owners:
        if id(module) in decides_for:
            return function(module)
    return False


def _wrap_predicate(model: nn.Module) -> Callable[[nn.Module], bool] | None:
    """``auto_wrap=True``: a module is its own FSDP unit if ``_fsdp_wrap`` or ``fsdp_wrap_fn`` says so (None when
    the model has neither: the root is the only unit, as in Composer)."""
    owners = _owners(model, "fsdp_wrap_fn")
    if not owners and not any(hasattr(module, "_fsdp_wrap") for module in model.modules()):
        return None

    def wraps(module: nn.Module) -> bool:
        decision = _choice(module, "_fsdp_wrap", owners)
        if isinstance(decision, Mapping):
            raise ValueError(
                f"fsdp_wrap_fn returned FSDP arguments {dict(decision)} for a {type(module).__name__}: per-module FSDP "
                "arguments are not supported. Return True or False; the strategy's settings apply to every unit."
            )
        return bool(decision)

    for module in model.modules():  # a refused decision fails when the Trainer is built, not at set-up
        wraps(module)
    return wraps


def _checkpointed_classes(model: nn.Module) -> set[type[nn.Module]]:
    """``activation_checkpointing=True``: the classes of the modules Composer would checkpoint, which must be every
    module of those classes (FSDPStrategy checkpoints whole classes)."""
    owners = _owners(model, "activation_checkpointing_fn")
    chosen = [module for module in model.modules() if _choice(module, "_activation_checkpointing", owners)]
    classes = {type(module) for module in chosen}
    chosen_ids = {id(module) for module in chosen}
    left_out = [m for m in model.modules() if isinstance(m, tuple(classes)) and id(m) not in chosen_ids]
    if left_out:
        raise ValueError(
            f"parallelism_config['fsdp']['activation_checkpointing']=True: the model's choice checkpoints some "
            f"{type(left_out[0]).__name__} modules but not all, and FSDPStrategy recomputes whole layer classes. "
            "Choose every module of a class (activation_checkpointing_fn / _activation_checkpointing), or pass "
            "strategy=FSDPStrategy(activation_checkpointing={...classes}) instead of parallelism_config."
        )
    return classes


def _mixed_precision(value: object) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if value == "FULL":
        return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    if value in ("DEFAULT", "PURE"):
        raise ValueError(
            f"parallelism_config['fsdp']['mixed_precision']={value!r} is not supported: it casts buffers to the "
            "precision's dtype, which FSDP2 does not do (buffers keep their dtype). Spell the dtypes out instead, "
            "e.g. {'param_dtype': 'bf16', 'reduce_dtype': 'fp32'}, or leave mixed_precision out to take the "
            "Trainer's precision (low-precision parameters in the forward, float32 gradient reduction)."
        )
    if not isinstance(value, Mapping):
        raise ValueError(
            f"parallelism_config['fsdp']['mixed_precision']={value!r} is not valid. Accepted: 'FULL' or a dict "
            "with param_dtype / reduce_dtype."
        )
    unknown = sorted(set(value) - {"param_dtype", "reduce_dtype", "buffer_dtype"})
    if unknown:
        raise ValueError(
            f"parallelism_config['fsdp']['mixed_precision'] has {unknown}; accepted: param_dtype, reduce_dtype."
        )
    if value.get("buffer_dtype") is not None:
        raise ValueError(
            f"parallelism_config['fsdp']['mixed_precision']['buffer_dtype']={value['buffer_dtype']!r} cannot be "
            "honoured: FSDP2 does not cast buffers, they keep their own dtype. Leave buffer_dtype out."
        )
    return MixedPrecisionPolicy(
        param_dtype=_dtype("param_dtype", value.get("param_dtype")),
        reduce_dtype=_dtype("reduce_dtype", value.get("reduce_dtype")),
    )


def _dtype(key: str, name: Any) -> torch.dtype | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise ValueError(
            f"parallelism_config['fsdp']['mixed_precision']['{key}']={name!r} is not valid. Accepted: {list(DTYPES)}."
        )
    return DTYPES[name]
