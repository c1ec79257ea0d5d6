"""Composer's names and what answers each here: the migration table of docs/coming-from-composer.md, made executable.

Every public module of Composer (0.32) that training scripts import is an entry: the module of this project whose
same-named public names answer it, the names that live elsewhere here or under another name, and those with no
counterpart, each refused with a one-line reason naming what to use instead. ``tests/compat/test_composer_drop_in.py``
checks that every entry answers as written and that the doc names it. Composer does not install beside torch 2.13,
so the mode always serves ``composer`` from this table alone (an import hook); it never overlays an installed one.
"""

from __future__ import annotations

from fabric.compat.aliases import AliasedModule, DropIn, Refused

_DEVICE = Refused("the Trainer takes the device by name: Trainer(device='cpu'|'gpu'|'mps').")
_OBJECT_STORE = Refused(
    "object stores are fsspec URLs here: save_folder='s3://bucket/run', load_path='s3://...', storage_options=."
)
_TYPE_ALIAS = "typing:Any"  # Composer's typing aliases: annotations keep working

COMPOSER = DropIn(
    project="Composer",
    document="docs/coming-from-composer.md",
    table={
        "composer": AliasedModule(ours="fabric.trainer", names={"Logger": "fabric.trainer.loggers:Logger"}),
        "composer.trainer": AliasedModule(ours="fabric.trainer"),
        "composer.core": AliasedModule(
            ours="fabric.trainer",
            names={
                "AlgorithmPass": "fabric.trainer.core.passes:AlgorithmPass",
                "ensure_data_spec": "fabric.trainer.data_spec:ensure_data_spec",
                "Serializable": "fabric.utilities.checkpoint_state:Stateful",
                "Batch": _TYPE_ALIAS,
                "Dataset": _TYPE_ALIAS,
                "JSON": _TYPE_ALIAS,
                "ensure_time": "fabric.trainer.core.time:ensure_time",
                "ensure_evaluator": Refused("pass Evaluator(...) objects or dataloaders as eval_dataloader."),
                "Precision": Refused("give precision as a string: Trainer(precision='amp_bf16' | 'fp32' | ...)."),
                "get_precision_context": Refused("the Trainer enters the precision's context itself."),
                "MemoryFormat": Refused("use torch.channels_last, or the ChannelsLast algorithm."),
                "Trace": Refused("the Engine keeps no trace of algorithm runs; log from the algorithm instead."),
                "TrainerMode": Refused("state.model.training says whether the model trains."),
            },
        ),
        "composer.models": AliasedModule(
            ours="fabric.trainer",
            names={
                "HuggingFaceModel": "fabric.trainer.huggingface:HuggingFaceModel",
                "Initializer": "fabric.trainer.classifier:Initializer",
                "write_huggingface_pretrained_from_composer_checkpoint": (
                    "fabric.trainer.huggingface:write_huggingface_pretrained"
                ),
            },
        ),
        "composer.algorithms": AliasedModule(
            ours="fabric.trainer.algorithms",
            names={
                "AugmentAndMixTransform": "fabric.trainer.algorithms.augmix:AugmentAndMixTransform",
                "RandAugmentTransform": "fabric.trainer.algorithms.randaugment:RandAugmentTransform",
                "SqueezeExcite2d": "fabric.trainer.algorithms.squeeze_excite:SqueezeExcite2d",
                "SqueezeExciteConv2d": "fabric.trainer.algorithms.squeeze_excite:SqueezeExciteConv2d",
                "ColOutTransform": Refused("ColOut applies to batches here; use the ColOut algorithm."),
                "NoOpModel": Refused("not provided; write the replacement module yourself."),
            },
        ),
        "composer.callbacks": AliasedModule(
            ours="fabric.trainer.callbacks",
            names={
                "CheckpointSaver": "fabric.trainer.checkpoint.saver:CheckpointSaver",
                "FreeOutputs": Refused("outputs are released after each batch already; nothing to add."),
                "Generate": Refused("not provided yet; generate from state.model in a callback of your own."),
                "ImageVisualizer": Refused("not provided; log images from a callback of your own."),
                "LoadCheckpoint": Refused("use Trainer(load_path=...)."),
                "MLPerfCallback": Refused("not provided."),
            },
        ),
        "composer.loggers": AliasedModule(
            ours="fabric.trainer.loggers",
            names={
                "TensorboardLogger": "fabric.trainer.loggers:TensorBoardLogger",
                "RemoteUploaderDownloader": _OBJECT_STORE,
                "CometMLLogger": Refused("not provided; use MLFlowLogger, WandBLogger or TensorboardLogger."),
                "MosaicMLLogger": Refused("the MosaicML platform is not supported."),
                "NeptuneLogger": Refused("not provided; use MLFlowLogger, WandBLogger or TensorboardLogger."),
                "SlackLogger": Refused("not provided."),
            },
        ),
        "composer.optim": AliasedModule(
            ours="fabric.trainer.schedulers",
            names={
                "DecoupledAdamW": "fabric.trainer.optimizers:DecoupledAdamW",
                "DecoupledSGDW": "fabric.trainer.optimizers:DecoupledSGDW",
                "ComposerScheduler": "fabric.trainer.schedulers:Scheduler",
                "compile_composer_scheduler": Refused("pass the scheduler to Trainer(schedulers=...)."),
            },
        ),
        "composer.optim.scheduler": AliasedModule(
            ours="fabric.trainer.schedulers", names={"ComposerScheduler": "fabric.trainer.schedulers:Scheduler"}
        ),
        "composer.metrics": AliasedModule(
            ours="fabric.trainer.metrics",
            names={"MAP": Refused("use torchmetrics.detection.MeanAveragePrecision (pycocotools, torchvision).")},
        ),
        "composer.profiler": AliasedModule(
            ours="fabric.trainer.profiler",
            names={
                "Marker": Refused("the Trainer marks its phases itself; use torch.profiler.record_function."),
                "ProfilerAction": Refused("the schedule returns torch.profiler.ProfilerAction values."),
                "SystemProfiler": Refused("system counters are not recorded (sys_prof_* options)."),
                "TorchProfiler": Refused("Profiler(torch_prof_folder=...) runs torch's profiler."),
            },
        ),
        "composer.utils": AliasedModule(
            names={
                "export_for_inference": "fabric.trainer.export:export_for_inference",
                "get_device": _DEVICE,
                "ensure_time": "fabric.trainer.core.time:ensure_time",
                "get_file": "fabric.plugins.io.file_helpers:get_file",
                "parse_uri": "fabric.plugins.io.file_helpers:parse_uri",
                "retry": "fabric.utilities.retry:retry",
                "format_name_with_dist_and_time": "fabric.trainer.file_names:format_name_with_dist_and_time",
                "configure_deterministic_mode": "fabric.utilities.seed:configure_deterministic_mode",
                "S3ObjectStore": _OBJECT_STORE,
                "ParallelismConfig": Refused("pass parallelism_config as a dict: {'fsdp': {...}}."),
                "FSDPConfig": Refused("pass parallelism_config={'fsdp': {...}} as a dict."),
            },
        ),
        "composer.utils.reproducibility": AliasedModule(
            names={
                "seed_all": "fabric:seed_everything",
                "configure_deterministic_mode": "fabric.utilities.seed:configure_deterministic_mode",
            },
        ),
        "composer.utils.dist": AliasedModule(
            ours="fabric.trainer.dist",
            names={
                "initialize_dist": Refused("the Trainer initialises torch.distributed when it is built."),
                "get_node_signal_file_name": Refused("use run_local_rank_zero_first() or barrier()."),
                "write_signal_file": Refused("use run_local_rank_zero_first() or barrier()."),
            },
        ),
        "composer.devices": AliasedModule(
            names={name: _DEVICE for name in ("Device", "DeviceCPU", "DeviceGPU", "DeviceMPS", "DeviceTPU")}
        ),
    },
)
