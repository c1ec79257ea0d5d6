"""Lightning Fabric's ``FSDPStrategy`` arguments (FSDP1 names and types) as :class:`FSDPStrategy`'s own FSDP2 settings.

Each Lightning argument is translated, or refused with a ``ValueError`` naming the value and what to use instead:

=============================================  ===================================================================
Lightning                                      FSDPStrategy (FSDP2)
=============================================  ===================================================================
``auto_wrap_policy``                           ``shard_modules``: a set of layer classes, ``ModuleWrapPolicy``,
                                               ``partial(transformer_auto_wrap_policy, transformer_layer_cls=...)``,
                                               or an FSDP1 ``(module, recurse, nonwrapped_numel) -> bool`` policy
``sharding_strategy``                          ``FULL_SHARD``: ``reshard_after_forward=True``; ``SHARD_GRAD_OP``:
                                               ``False``; ``HYBRID_SHARD``: ``hybrid_shard=True``;
                                               ``_HYBRID_SHARD_ZERO2``: both; ``NO_SHARD``: ``replicate_only=True``
``activation_checkpointing_policy``            ``activation_checkpointing`` (layer classes)
``cpu_offload=CPUOffload(offload_params=b)``   ``cpu_offload=b``
``mixed_precision=MixedPrecision(...)``        ``mixed_precision=MixedPrecisionPolicy(...)`` (no ``buffer_dtype``)
``use_orig_params``, ``limit_all_gathers``     ``True``: always so in FSDP2; ``False`` refused
``device_mesh=(replicate, shard)``             ``mesh=MeshPlan(data_parallel_replicate=replicate, data_parallel=shard)``
``process_group``, ...                         refused, naming FSDP2's equivalent (:data:`REFUSED`)
=============================================  ===================================================================
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.fsdp import CPUOffload, MixedPrecision, MixedPrecisionPolicy, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy

from fabric.strategies.mesh import DATA_PARALLEL_DIMS, MeshPlan

#: FSDP1's callable auto-wrap policy: ``(module, recurse, nonwrapped_numel) -> bool``.
Fsdp1Policy = Callable[..., bool]

#: ``sharding_strategy`` -> (reshard_after_forward, hybrid_shard, replicate_only).
SHARDING_STRATEGIES: dict[str, tuple[bool, bool, bool]] = {
    "FULL_SHARD": (True, False, False),
    "SHARD_GRAD_OP": (False, False, False),
    "HYBRID_SHARD": (True, True, False),
    "_HYBRID_SHARD_ZERO2": (False, True, False),
    "NO_SHARD": (True, False, True),
}

#: FSDP1 behaviours FSDP2 always has: accepted as ``True``, refused as ``False`` with the reason.
ALWAYS_ON: dict[str, str] = {
    "use_orig_params": "FSDP2 has no flat parameter: the module always keeps its own parameters (as DTensor shards)",
    "limit_all_gathers": "FSDP2 always bounds the all-gathers in flight (by its stream handling, without blocking "
    "the CPU)",
}

#: Lightning/FSDP1 arguments with no FSDPStrategy setting, and what to use instead.
REFUSED: dict[str, str] = {
    "process_group": "the process groups come from the device mesh FSDPStrategy builds at launch; choose its "
    "shape with mesh=MeshPlan(data_parallel_replicate=..., data_parallel=...) (Lightning: device_mesh=(replicate, "
    "shard))",
    "forward_prefetch": "FSDP2 has no such flag; after fabric.setup, call "
    "unit.set_modules_to_forward_prefetch([next units]) on the sharded layers (FSDPModule)",
    "backward_prefetch": "FSDP2 always prefetches the next unit's all-gather in backward (as BACKWARD_PRE); to "
    "choose the order, call unit.set_modules_to_backward_prefetch([...]) on the sharded layers after fabric.setup",
    "ignored_modules": "FSDPStrategy shards every parameter of the model (FSDP2's fully_shard(ignored_params=...) "
    "is not exposed); keep such modules out of the module given to fabric.setup",
    "ignored_states": "FSDPStrategy shards every parameter of the model (FSDP2's fully_shard(ignored_params=...) "
    "is not exposed); keep such modules out of the module given to fabric.setup",
    "param_init_fn": "build the model under fabric.init_module(empty_init=True): setup materialises each rank's "
    "shards of the meta model and runs every reset_parameters(), or the param_init_fn(module) method of the model "
    "or a submodule that defines one (Composer's convention)",
    "device_id": "the device comes from Fabric(accelerator=..., devices=...)",
}


@dataclass(frozen=True)
class FSDPSettings:
    """FSDPStrategy's own settings, after translation (see :class:`~fabric.strategies.fsdp.FSDPStrategy`)."""

    shard_modules: ShardPolicy | None = None
    reshard_after_forward: bool = True
    hybrid_shard: bool = False
    replicate_only: bool = False
    cpu_offload: bool = False
    activation_checkpointing: set[type[nn.Module]] | None = None
    mixed_precision: MixedPrecisionPolicy | None = None
    mesh: MeshPlan | None = None


def resolve_settings(own: Mapping[str, Any], lightning: Mapping[str, Any]) -> FSDPSettings:
    """The settings from FSDPStrategy's own arguments (``None``: not given) and Lightning's ``lightning``.

    Raises ``ValueError`` for a refused or unknown Lightning argument, and for a Lightning argument given
    together with the own argument it sets.
    """
    values: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for name, value in own.items():
        if value is not None:
            values[name] = _OWN_FORMS.get(name, _unchanged)(value)
            given_as[name] = name
    for name, value in lightning.items():
        for setting, setting_value in translate(name, value).items():
            if setting in given_as:
                raise ValueError(
                    f"FSDPStrategy got both {name}= (Lightning's name) and {given_as[setting]}=, which set the same "
                    f"thing ({setting}); pass only one of them."
                )
            values[setting] = setting_value
            given_as[setting] = name
    if values.get("mesh") is not None:
        check_mesh_agrees(values["mesh"], bool(values.get("replicate_only")))
    if values.get("hybrid_shard") and values.get("replicate_only"):
        raise ValueError(
            "FSDPStrategy got hybrid_shard=True (shard within each node) and replicate_only=True (shard nothing); "
            "pass one of them."
        )
    return FSDPSettings(**values)


def translate(name: str, value: Any) -> dict[str, Any]:
    """The own settings Lightning's argument ``name=value`` stands for; ``ValueError`` if it has none."""
    if name == "auto_wrap_policy":
        return {"shard_modules": shard_policy(value)}
    if name == "activation_checkpointing_policy":
        return {"activation_checkpointing": checkpointed_classes(value)}
    if name == "device_mesh":
        return {"mesh": mesh_plan(value, argument="device_mesh")}
    if name == "sharding_strategy":
        reshard, hybrid, replicate = SHARDING_STRATEGIES[sharding_strategy_name(value)]
        return {"reshard_after_forward": reshard, "hybrid_shard": hybrid, "replicate_only": replicate}
    if name in ALWAYS_ON:
        if value is True:
            return {}
        raise ValueError(f"FSDPStrategy({name}={value!r}) is not possible: {ALWAYS_ON[name]}. Remove {name}.")
    if name in REFUSED:
        raise ValueError(f"FSDPStrategy({name}=...) is not supported: {REFUSED[name]}.")
    accepted = ["auto_wrap_policy", "activation_checkpointing_policy", "sharding_strategy", "device_mesh", *ALWAYS_ON]
    raise ValueError(
        f"FSDPStrategy has no argument {name}={value!r}. Besides its own arguments it accepts Lightning's "
        f"{', '.join(accepted)}."
    )


def sharding_strategy_name(value: object) -> str:
    """``FULL_SHARD``, ... from a ``ShardingStrategy`` or a string in any case."""
    name = value.name if isinstance(value, ShardingStrategy) else value.upper() if isinstance(value, str) else None
    if name not in SHARDING_STRATEGIES:
        raise ValueError(
            f"sharding_strategy={value!r} is not valid. Accepted: {', '.join(SHARDING_STRATEGIES)} "
            "(in any case) or a torch.distributed.fsdp.ShardingStrategy."
        )
    return name


def shard_policy(policy: object) -> ShardPolicy:
    """``shard_modules`` from Lightning's ``auto_wrap_policy``."""
    classes = layer_classes(policy)
    if classes is not None:
        return classes
    if callable(policy) and not isinstance(policy, type) and _takes_fsdp1_arguments(policy):
        return UnitsLikeFsdp1(policy)
    raise ValueError(
        f"auto_wrap_policy={policy!r} is not valid. Accepted: a set of nn.Module classes, ModuleWrapPolicy, "
        "partial(transformer_auto_wrap_policy, transformer_layer_cls=...), or an FSDP1 policy "
        "(module, recurse, nonwrapped_numel) -> bool. For a (module) -> bool predicate, pass shard_modules=."
    )


def checkpointed_classes(policy: object) -> set[type[nn.Module]]:
    """``activation_checkpointing`` from Lightning's ``activation_checkpointing_policy``."""
    classes = layer_classes(policy)
    if classes is None:
        raise ValueError(
            f"activation_checkpointing_policy={policy!r} is not valid: FSDPStrategy recomputes whole layer "
            "classes. Accepted: a set of nn.Module classes, ModuleWrapPolicy or "
            "partial(transformer_auto_wrap_policy, transformer_layer_cls=...); or pass activation_checkpointing={...}."
        )
    return classes


def layer_classes(policy: object) -> set[type[nn.Module]] | None:
    """The module classes a policy names (a collection, ``ModuleWrapPolicy``, a transformer policy), else ``None``."""
    if isinstance(policy, ModuleWrapPolicy):
        policy = getattr(policy, "_module_classes", None)
    elif isinstance(policy, functools.partial) and policy.func is transformer_auto_wrap_policy:
        policy = policy.keywords.get("transformer_layer_cls")
    if isinstance(policy, (set, frozenset, list, tuple)) and all(
        isinstance(cls, type) and issubclass(cls, nn.Module) for cls in policy
    ):
        return set(policy)
    return None


class UnitsLikeFsdp1:
    """An FSDP1 auto-wrap policy, choosing the units as FSDP1's recursive wrap does (see :meth:`units`)."""

    def __init__(self, policy: Fsdp1Policy) -> None:
        self.policy = policy

    def units(self, root: nn.Module) -> set[nn.Module]:
        """FSDP1's choice, top down: a module is entered when the policy allows recursing into it
        (``recurse=True`` with all its parameters) and becomes a unit when the policy wraps it
        (``recurse=False``) with the parameters not already in a unit below it. The root is never one."""
        chosen: set[nn.Module] = set()

        def visit(module: nn.Module) -> int:  # how many of module's parameters are in units
            total = sum(parameter.numel() for parameter in module.parameters())
            if not self.policy(module=module, recurse=True, nonwrapped_numel=total):
                return 0
            in_units = sum(visit(child) for child in module.children())
            if module is not root and self.policy(module=module, recurse=False, nonwrapped_numel=total - in_units):
                chosen.add(module)
                return total
            return in_units

        visit(root)
        return chosen

    def __repr__(self) -> str:
        return f"UnitsLikeFsdp1({self.policy!r})"


#: Which submodules get their own FSDP unit: layer classes, a predicate on each submodule, or FSDP1's policy.
ShardPolicy = set[type[nn.Module]] | Callable[[nn.Module], bool] | UnitsLikeFsdp1


def shard_units(policy: ShardPolicy | None, root: nn.Module) -> set[nn.Module]:
    """The submodules of ``root`` (not ``root`` itself) that ``policy`` makes FSDP units of."""
    if policy is None:
        return set()
    if isinstance(policy, UnitsLikeFsdp1):
        return policy.units(root)
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = tuple(policy)
        return {module for module in root.modules() if module is not root and isinstance(module, classes)}
    return {module for module in root.modules() if module is not root and policy(module)}


def _takes_fsdp1_arguments(policy: Callable[..., Any]) -> bool:
    try:
        inspect.signature(policy).bind(module=None, recurse=False, nonwrapped_numel=0)
    except TypeError:
        return False
    except ValueError:  # no signature to inspect (a builtin): take it as it is
        return True
    return True


def cpu_offload_flag(value: object) -> bool:
    """``cpu_offload`` from ``True``/``False`` or FSDP1's ``CPUOffload(offload_params=...)``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, CPUOffload):
        return value.offload_params
    raise ValueError(
        f"cpu_offload={value!r} is not valid. Accepted: True, False or "
        "torch.distributed.fsdp.CPUOffload(offload_params=...)."
    )


def mixed_precision_policy(value: object) -> MixedPrecisionPolicy:
    """FSDP2's ``MixedPrecisionPolicy`` from itself or from FSDP1's ``MixedPrecision``.

    ``cast_forward_inputs`` is on when FSDP1 casts the root's or every unit's inputs. FSDP1's
    ``_module_classes_to_ignore`` (BatchNorm kept in float32 by default) has no FSDP2 counterpart: every
    unit computes in ``param_dtype``.
    """
    if isinstance(value, MixedPrecisionPolicy):
        return value
    if not isinstance(value, MixedPrecision):
        raise ValueError(
            f"mixed_precision={value!r} is not valid. Accepted: torch.distributed.fsdp.MixedPrecisionPolicy "
            "(FSDP2) or MixedPrecision (FSDP1)."
        )
    if value.buffer_dtype is not None:
        raise ValueError(
            f"mixed_precision=MixedPrecision(buffer_dtype={value.buffer_dtype}) cannot be honoured: FSDP2 does not "
            "cast buffers, they keep their own dtype. Leave buffer_dtype=None, and convert the buffers yourself "
            "before fabric.setup if they should be in another dtype (e.g. buffer.data = buffer.to(dtype))."
        )
    if value.keep_low_precision_grads:
        raise ValueError(
            "mixed_precision=MixedPrecision(keep_low_precision_grads=True) cannot be honoured: FSDP2 gives the "
            "gradients the sharded parameters' dtype. Leave it False (reduce_dtype sets the reduction's dtype), or "
            "train in low precision throughout with precision='bf16-true'."
        )
    return MixedPrecisionPolicy(
        param_dtype=value.param_dtype,
        reduce_dtype=value.reduce_dtype,
        cast_forward_inputs=value.cast_forward_inputs or value.cast_root_forward_inputs,
    )


def mesh_plan(value: object, argument: str = "mesh") -> MeshPlan:
    """The :class:`MeshPlan` from itself or from Lightning's ``(replicate, shard)`` sizes."""
    if isinstance(value, MeshPlan):
        return value
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(size, int) for size in value):
        return MeshPlan(data_parallel_replicate=value[0], data_parallel=value[1])
    raise ValueError(
        f"{argument}={value!r} is not valid. Accepted: a (replicate, shard) tuple of ints or a "
        "fabric.strategies.MeshPlan; a DeviceMesh cannot be taken, the mesh is built at launch from the plan."
    )


def check_mesh_agrees(mesh: MeshPlan, replicate_only: bool) -> None:
    """FSDP takes data-parallel dimensions only (tensor parallelism needs ``ModelParallelStrategy``'s
    ``parallelize_fn``), and with ``replicate_only`` a mesh that shards nothing."""
    others = {name: degree for name, degree in mesh.degrees.items() if name not in DATA_PARALLEL_DIMS and degree != 1}
    if others:
        taker = "ModelParallelStrategy(parallelize_fn, mesh=...)"
        if "pipeline_parallel" in others:
            taker = "ModelParallelStrategy(mesh=..., pipeline=PipelinePlan(...))"
        raise ValueError(
            f"FSDPStrategy(mesh={mesh!r}) shards over the data-parallel dimensions only; "
            f"{', '.join(f'{name}={degree}' for name, degree in others.items())} needs {taker}."
        )
    if replicate_only and mesh.data_parallel != 1:
        raise ValueError(
            f"FSDPStrategy got replicate_only=True (NO_SHARD) and mesh={mesh!r}, which shards over "
            f"data_parallel={mesh.data_parallel}; give the mesh data_parallel=1, or drop replicate_only."
        )


def _unchanged(value: Any) -> Any:
    return value


#: Own arguments that also take Lightning's (FSDP1) types, and their conversion to the own type.
_OWN_FORMS: dict[str, Callable[[Any], Any]] = {
    "cpu_offload": cpu_offload_flag,
    "mixed_precision": mixed_precision_policy,
    "mesh": mesh_plan,
}
