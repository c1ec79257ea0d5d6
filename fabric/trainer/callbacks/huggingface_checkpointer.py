"""``HuggingFaceCheckpointer``: llm-foundry's callback, a Hugging Face folder of the model every ``save_interval``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from fabric.plugins.io.huggingface import DEFAULT_MAX_FILE_BYTES, check_upload_target
from fabric.plugins.io.storage import filesystem, is_remote
from fabric.strategies.huggingface_checkpoint import check_supported, save_huggingface
from fabric.trainer.callbacks._utils import check_count, check_name, format_name, user_model
from fabric.trainer.core.state import require_fabric
from fabric.trainer.intervals import IntervalInput, SavesAtIntervals, create_interval

if TYPE_CHECKING:
    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State

#: ``precision=``: the dtype of the floating-point weights in the folder.
PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HuggingFaceCheckpointer(SavesAtIntervals):
    """Every ``save_interval`` (and when training ends) write a :class:`~fabric.trainer.huggingface.HuggingFaceModel`
    as a folder that ``transformers``' ``from_pretrained`` (model and ``AutoTokenizer``) loads:
    ``save_folder/huggingface/<huggingface_folder_name>`` (``ba{batch}`` by default; ``{run_name}``, ``{epoch}``,
    ``{batch}``, ``{sample}``, ``{token}`` may be used in either).

    Every rank writes only its own shards (FSDP2, HSDP and tensor parallelism included: no rank gathers the model),
    in safetensors files of at most ``max_file_bytes`` with their index, the config and the tokenizer's files; the
    folder appears complete or not at all (``fabric.save(..., format="huggingface")``). ``precision`` is the dtype of
    the floating-point weights written (``"float32"``, ``"bfloat16"`` or ``"float16"``); ``overwrite=False`` stops
    training rather than replace an existing folder. The folder is local, on a shared file system, or at an object store
    URL (``s3://...``: every rank uploads the weight files it owns, rank 0 the index, last); llm-foundry's MLflow
    registration (``mlflow_registered_model_name``) is not provided. The folders written are in
    :attr:`saved`.
    """

    def __init__(
        self,
        save_folder: str,
        save_interval: IntervalInput,
        huggingface_folder_name: str = "ba{batch}",
        precision: str = "float32",
        overwrite: bool = True,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        mlflow_registered_model_name: str | None = None,
        mlflow_logging_config: Mapping[str, Any] | None = None,
    ) -> None:
        if mlflow_registered_model_name is not None or mlflow_logging_config is not None:
            raise ValueError(
                "HuggingFaceCheckpointer's MLflow registration (mlflow_registered_model_name, mlflow_logging_config) "
                "is not provided: register the folder it writes with mlflow yourself."
            )
        check_name(save_folder, "save_folder")
        if is_remote(save_folder):
            try:
                check_upload_target(save_folder)
            except ValueError as error:
                raise ValueError(f"HuggingFaceCheckpointer(save_folder={save_folder!r}): {error}") from None
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r}: accepted values are {list(PRECISIONS)}.")
        if not isinstance(overwrite, bool):
            raise ValueError(f"overwrite must be True or False; got {overwrite!r}.")
        self.save_folder = save_folder
        self.folder_name = check_name(huggingface_folder_name, "huggingface_folder_name")
        self.interval = create_interval(save_interval, name="save_interval")
        self.dtype = PRECISIONS[precision]
        self.overwrite = overwrite
        self.max_file_bytes = check_count(max_file_bytes, "max_file_bytes", 1)
        #: The folders written, in order.
        self.saved: list[str] = []

    @override
    def fit_start(self, state: State, logger: Logger) -> None:
        """A model that is not a HuggingFaceModel, or a strategy that cannot write the folder, fails before training."""
        _model_and_files(state)
        check_supported(require_fabric(state).strategy, "HuggingFaceCheckpointer: writing")

    @override
    def save(self, state: State) -> str:
        """Write the folder now (on every rank: it is a collective); returns its path."""
        fabric = require_fabric(state)
        path = os.path.join(format_name(self.save_folder, state), "huggingface", format_name(self.folder_name, state))
        if not self.overwrite and fabric.broadcast(_exists(path) if fabric.is_global_zero else False):
            raise FileExistsError(f"{path} exists; pass overwrite=True to replace it.")
        module, files = _model_and_files(state)
        save_huggingface(fabric.strategy, path, module, self.max_file_bytes, dtype=self.dtype, files=files)
        self.saved.append(path)
        return path


def _exists(path: str) -> bool:
    """Whether something is at ``path``, a local path or a URL."""
    if not is_remote(path):
        return os.path.exists(path)
    fs, inner = filesystem(path)
    return bool(fs.exists(inner))


def _model_and_files(state: State) -> tuple[torch.nn.Module, dict[str, bytes]]:
    """The ``transformers`` model a HuggingFaceModel wraps and its tokenizer's files, from what its checkpoints save
    with the weights (its extra state); any other model is refused, naming its class."""
    model = user_model(state)
    saves_extra_state = type(model).get_extra_state is not torch.nn.Module.get_extra_state
    extra = model.get_extra_state() if saves_extra_state else None
    inner = getattr(model, "model", None)
    if not (isinstance(extra, Mapping) and "config" in extra and isinstance(inner, torch.nn.Module)):
        raise ValueError(
            f"HuggingFaceCheckpointer writes a HuggingFaceModel (fabric.trainer.huggingface); the Trainer's model is "
            f"a {type(model).__name__}."
        )
    return inner, dict(extra.get("tokenizer", {}))
