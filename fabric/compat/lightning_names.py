"""Lightning Fabric's names and what answers each here: the migration table, made executable.

Every public module of ``lightning.fabric`` (2.6) that programs import is an entry: the module of this project
whose same-named public names answer it, the names that live elsewhere here or under another name, and those with
no counterpart, each refused with a one-line reason naming what to use instead. docs/coming-from-lightning.md
describes this table, and ``tests/compat/test_lightning_drop_in.py`` checks the two agree. Private names appear
only where real programs use them (litgpt: ``_lazy_load``, ``_NotYetLoadedTensor``).

``lightning`` itself: ``L.Fabric`` and ``L.seed_everything`` are ours; ``LightningModule``, ``LightningDataModule``,
``Trainer``, ``Callback`` and ``lightning.pytorch`` are Lightning's own (its Trainer), which stay Lightning's when
it is installed and are refused by name when it is not.
"""

from __future__ import annotations

from fabric.compat.aliases import AliasedModule, DropIn, Refused

_XLA = Refused("TPUs (XLA) are not supported; use Lightning Fabric itself for TPUs.")
_LIGHTNING_ONLY = Refused(
    "it is Lightning's Trainer side (lightning.pytorch), not part of this project; install lightning beside "
    "torch-fabric (pip install lightning) and its pieces stay Lightning's, or write a plain class instead."
)
_DP = Refused("DataParallel (strategy='dp') is not supported; use DDPStrategy (strategy='ddp').")
_FP8 = Refused(
    "TransformerEngine is not used here; float8 training runs on torchao: precision='fp8-mixed', or "
    "fabric.plugins.precision.float8.Float8Precision(recipe=..., module_filter=...)."
)
_NOT_YET = "not provided yet; "

#: Lightning's precision plugins that are not in ``fabric.plugins.precision`` (``lightning.fabric.plugins`` and
#: ``lightning.fabric.plugins.precision`` both export them).
_PRECISIONS_ELSEWHERE: dict[str, str | Refused] = {
    "BitsandbytesPrecision": "fabric.plugins.precision.bitsandbytes:BitsandbytesPrecision",
    "DeepSpeedPrecision": "fabric.strategies.deepspeed.precision:DeepSpeedPrecision",
    "FSDPPrecision": Refused(
        "FSDPStrategy takes the ordinary precision plugins; pass precision='bf16-mixed' (or 'bf16-true')."
    ),
    "TransformerEnginePrecision": _FP8,
    "XLAPrecision": _XLA,
}

#: The names of ``lightning`` that are Lightning's own even in drop-in mode (kept as they are when it is installed).
LIGHTNING_OWN_NAMES = ("Callback", "LightningDataModule", "LightningModule", "Trainer", "__version__")

LIGHTNING_FABRIC = DropIn(
    project="lightning.fabric",
    document="docs/coming-from-lightning.md",
    table={
        "lightning": AliasedModule(
            names={
                "Fabric": "fabric:Fabric",
                "seed_everything": "fabric:seed_everything",
                **dict.fromkeys(LIGHTNING_OWN_NAMES[:-1], _LIGHTNING_ONLY),
            }
        ),
        "lightning.pytorch": _LIGHTNING_ONLY,
        "lightning.fabric": AliasedModule(
            ours="fabric",
            names={"is_wrapped": "fabric.utilities:is_wrapped"},
        ),
        "lightning.fabric.fabric": AliasedModule(names={"Fabric": "fabric:Fabric"}),
        "lightning.fabric.accelerators": AliasedModule(
            ours="fabric.accelerators",
            names={
                "TPUAccelerator": _XLA,
                "XLAAccelerator": _XLA,
                "find_usable_cuda_devices": Refused(
                    _NOT_YET + "pass devices='auto' or a list of GPU indices, e.g. devices=[0, 1]."
                ),
            },
        ),
        "lightning.fabric.strategies": AliasedModule(
            ours="fabric.strategies",
            names={
                "DataParallelStrategy": _DP,
                "SingleDeviceXLAStrategy": _XLA,
                "SingleTPUStrategy": _XLA,
                "XLAFSDPStrategy": _XLA,
                "XLAStrategy": _XLA,
            },
        ),
        "lightning.fabric.plugins": AliasedModule(
            names={
                "CheckpointIO": "fabric.plugins.io:CheckpointIO",
                "TorchCheckpointIO": "fabric.plugins.io:TorchCheckpointIO",
                "ClusterEnvironment": "fabric.plugins.environments:ClusterEnvironment",
                "Precision": "fabric.plugins.precision:Precision",
                "DoublePrecision": "fabric.plugins.precision:DoublePrecision",
                "HalfPrecision": "fabric.plugins.precision:HalfPrecision",
                "MixedPrecision": "fabric.plugins.precision:MixedPrecision",
                **_PRECISIONS_ELSEWHERE,
                "XLACheckpointIO": _XLA,
            }
        ),
        "lightning.fabric.plugins.environments": AliasedModule(
            ours="fabric.plugins.environments",
            names={
                "LightningEnvironment": "fabric.plugins.environments:LocalEnvironment",
                "XLAEnvironment": _XLA,
            },
        ),
        "lightning.fabric.plugins.precision": AliasedModule(
            ours="fabric.plugins.precision",
            names=_PRECISIONS_ELSEWHERE,
        ),
        "lightning.fabric.plugins.io": AliasedModule(ours="fabric.plugins.io", names={"XLACheckpointIO": _XLA}),
        "lightning.fabric.loggers": AliasedModule(ours="fabric.loggers"),
        "lightning.fabric.utilities": AliasedModule(
            ours="fabric.utilities",
            names={
                "move_data_to_device": "fabric.utilities.apply_func:move_data_to_device",
                "rank_zero_only": "fabric.utilities.rank_zero:rank_zero_only",
                "rank_zero_info": "fabric.utilities.rank_zero:rank_zero_info",
                "rank_zero_warn": "fabric.utilities.rank_zero:rank_zero_warn",
                "rank_zero_deprecation": Refused(_NOT_YET + "use rank_zero_warn(..., category=DeprecationWarning)."),
                "AttributeDict": Refused("not provided; use a dict or types.SimpleNamespace."),
                "LightningEnum": Refused("not provided; use enum.Enum with str as a base (class E(str, Enum))."),
                "disable_possible_user_warnings": Refused(
                    "not provided; use warnings.filterwarnings('ignore', category=UserWarning)."
                ),
                "is_shared_filesystem": Refused(
                    _NOT_YET + "a sharded save checks that every rank's shards reached rank 0 and fails loudly if not."
                ),
                "suggested_max_num_workers": Refused(
                    _NOT_YET + "use min(os.cpu_count() // local_world_size, your cap) DataLoader workers."
                ),
            },
        ),
        "lightning.fabric.utilities.throughput": AliasedModule(
            names={
                "Throughput": "fabric.utilities.throughput:Throughput",
                "ThroughputMonitor": "fabric.utilities.throughput:ThroughputMonitor",
                "measure_flops": "fabric.utilities.throughput:measure_flops",
                "get_available_flops": Refused(
                    "use fabric.utilities.throughput.device_peak_flops(device_name, dtype), or pass "
                    "available_flops to Throughput yourself."
                ),
            }
        ),
        "lightning.fabric.utilities.rank_zero": AliasedModule(ours="fabric.utilities.rank_zero"),
        "lightning.fabric.utilities.seed": AliasedModule(names={"seed_everything": "fabric:seed_everything"}),
        "lightning.fabric.utilities.apply_func": AliasedModule(
            names={"move_data_to_device": "fabric.utilities.apply_func:move_data_to_device"}
        ),
        "lightning.fabric.utilities.load": AliasedModule(
            names={
                "_lazy_load": "fabric.utilities.load:lazy_load",
                "_NotYetLoadedTensor": "fabric.utilities.load:NotYetLoadedTensor",
            }
        ),
        "lightning.fabric.utilities.init": AliasedModule(
            names={
                "_materialize_meta_tensors": Refused(
                    _NOT_YET + "build the model with fabric.init_module(empty_init=True) and load its weights."
                )
            }
        ),
    },
)
