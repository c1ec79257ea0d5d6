"""Composer's names and what answers each here: the migration table of docs/coming-from-composer.md, made executable.

Every public module of Composer (0.32) that training scripts import is an entry: the module of this project whose
same-named public names answer it, the names that live elsewhere here or under another name, and those with no
counterpart, each refused with a one-line reason naming what to use instead. ``tests/compat/test_composer_drop_in.py``
checks that every entry answers as written and that the doc names it. Composer does not install beside torch 2.13,
so the mode always serves ``composer`` from this table alone (an import hook); it never overlays an installed one.
"""

from __future__ import annotations

from fabric.compat.aliases import AliasedModule, DropIn, Refused

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
        "composer.core.callback": AliasedModule(names={"Callback": "fabric.trainer:Callback"}),
        "composer.core.data_spec": AliasedModule(
            names={
                "DataSpec": "fabric.trainer:DataSpec",
                "ensure_data_spec": "fabric.trainer.data_spec:ensure_data_spec",
                "_default_split_batch": "fabric.trainer.microbatch:split_batch",
                "_split_list": "fabric.trainer.microbatch:split_list",
            },
        ),
        "composer.core.state": AliasedModule(
            names={
                "State": "fabric.trainer:State",
                "fsdp_state_dict_type_context": Refused(
                    "FSDP1's state-dict context; FSDP2 here: the Trainer's checkpoints are sharded (DCP) or full."
                ),
            },
        ),
        "composer.core.types": AliasedModule(
            names={"Batch": _TYPE_ALIAS, "Dataset": _TYPE_ALIAS, "JSON": _TYPE_ALIAS},
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
        "composer.models.huggingface": AliasedModule(
            names={
                "HuggingFaceModel": "fabric.trainer.huggingface:HuggingFaceModel",
                "peft_installed": "fabric.trainer.huggingface:PEFT_SUPPORTED",
                "maybe_get_underlying_model": Refused(
                    "FSDP1 wrapping of Hugging Face models; FSDP2 here shards the model in place."
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
                "ImageVisualizer": Refused("not provided; log images from a callback of your own."),
                "LoadCheckpoint": Refused("use Trainer(load_path=...)."),
                "MLPerfCallback": Refused("not provided."),
            },
        ),
        "composer.callbacks.checkpoint_saver": AliasedModule(
            names={"CheckpointSaver": "fabric.trainer.checkpoint.saver:CheckpointSaver"}
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
        "composer.loggers.logger_destination": AliasedModule(
            names={"LoggerDestination": "fabric.trainer.loggers:LoggerDestination"}
        ),
        "composer.loggers.mosaicml_logger": AliasedModule(
            ours="fabric.compat.mosaicml_platform",
            names={"MosaicMLLogger": Refused("the MosaicML platform is not supported.")},
        ),
        "composer.loggers.remote_uploader_downloader": AliasedModule(names={"RemoteUploaderDownloader": _OBJECT_STORE}),
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
            ours="fabric.trainer.schedulers",
            names={
                "ComposerScheduler": "fabric.trainer.schedulers:Scheduler",
                "_convert_time": Refused(
                    "schedulers written on Composer's internals (llm-foundry's inv_sqrt_with_warmup, "
                    "warmup_stable_decay) are not supported; use the schedulers of fabric.trainer.schedulers."
                ),
            },
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
                "get_device": "fabric.trainer.devices:get_device",
                "MissingConditionalImportError": "fabric.utilities.lazy:MissingConditionalImportError",
                "ObjectStore": _OBJECT_STORE,
                "maybe_create_object_store_from_uri": _OBJECT_STORE,
                "maybe_create_remote_uploader_downloader_from_uri": (
                    "fabric.plugins.io.file_helpers:maybe_create_remote_uploader_downloader_from_uri"
                ),
                "create_interval_scheduler": "fabric.trainer.intervals:create_interval_scheduler",
                "TPConfig": "fabric.trainer.parallelism:TPConfig",
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
        "composer.utils.misc": AliasedModule(
            names={"create_interval_scheduler": "fabric.trainer.intervals:create_interval_scheduler"}
        ),
        "composer.utils.file_helpers": AliasedModule(
            names={
                "get_file": "fabric.plugins.io.file_helpers:get_file",
                "parse_uri": "fabric.plugins.io.file_helpers:parse_uri",
                "list_remote_objects": _OBJECT_STORE,
            },
        ),
        "composer.utils.import_helpers": AliasedModule(
            names={"MissingConditionalImportError": "fabric.utilities.lazy:MissingConditionalImportError"}
        ),
        "composer.utils.object_store": AliasedModule(
            names={"ObjectStore": _OBJECT_STORE, "ObjectStoreTransientError": "builtins:ConnectionError"}
        ),
        "composer.utils.retrying": AliasedModule(names={"retry": "fabric.utilities.retry:retry"}),
        "composer.utils.reproducibility": AliasedModule(
            names={
                "seed_all": "fabric:seed_everything",
                "configure_deterministic_mode": "fabric.utilities.seed:configure_deterministic_mode",
            },
        ),
        "composer.utils.dist": AliasedModule(ours="fabric.trainer.dist"),
        "composer.devices": AliasedModule(
            ours="fabric.trainer.devices",
            names={"DeviceTPU": Refused("TPUs are not supported; use 'cpu', 'gpu' or 'mps'.")},
        ),
    },
)
