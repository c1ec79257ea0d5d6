"""``HuggingFaceModel``: train a ``transformers`` ``PreTrainedModel`` whose forward returns a loss with the Trainer.

Needs the ``transformers`` extra (``pip install -e ".[transformers]"`` from the checkout); it is imported only
when a ``HuggingFaceModel`` is made. Batches are mappings of the model's inputs (``input_ids``,
``attention_mask``, ``labels``, ...), as a ``transformers`` data collator makes them::

    model = HuggingFaceModel(AutoModelForCausalLM.from_config(config), tokenizer=tokenizer)
    trainer = Trainer(model=model, train_dataloader=loader, max_duration="1ep", optimizers=...,
                      save_folder="checkpoints")
    trainer.fit()
    write_huggingface_pretrained("checkpoints/ep1-ba10-rank0.pt", "exported")
    AutoModelForCausalLM.from_pretrained("exported")   # the trained weights

* ``loss``: the loss the model's forward returned (the batch must hold ``labels``).
* Tokens (``timestamp.token``, ``"tok"`` durations): the ones ``attention_mask`` keeps, else the
  ``input_ids`` that are not the tokenizer's padding token, else every ``input_id``.
* Evaluation: ``eval_forward`` returns the model's output; the default eval metric ``loss`` is its
  sample-weighted mean. Other metrics (``metrics=`` for training, ``eval_metrics=``) are torchmetrics
  objects updated with ``(logits, labels)`` (shifted by one position for causal language models, as
  their loss is) or callables ``(outputs, batch) -> number``.
* Checkpoints: the model's ``config`` and class, and the tokenizer's files when there is one, are saved
  with its weights (the module's extra state), so :func:`write_huggingface_pretrained` turns a one-file
  Trainer checkpoint into a folder that ``from_pretrained`` (model and ``AutoTokenizer``) loads. Sharded
  checkpoints: ``fabric consolidate`` them first.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from fabric.plugins.io.huggingface import config_file
from fabric.plugins.io.storage import filesystem, is_remote
from fabric.plugins.io.temporaries import owned_temporary, remove_abandoned, remove_temporary, temporary_sibling
from fabric.trainer.model import ComposerModel
from fabric.utilities.lazy import install_hint

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

#: The key of an evaluation batch of llm-foundry's in-context learning tasks naming its kind ("icl_task", "generate").
EVAL_MODE = "mode"
#: The label cross-entropy ignores (torch's and transformers' default), given to the last position's logits.
IGNORE_INDEX = -100
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
#: Whether HuggingFaceModel takes PEFT adapters (Composer's ``peft_installed``, which programs read before passing a
#: ``peft_config``): not yet, so they refuse such configs themselves.
PEFT_SUPPORTED = False
_INSTALL = f"HuggingFaceModel needs transformers: {install_hint('transformers', 'transformers')}"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ImportError(_INSTALL) from error
    return transformers


#: Metrics as Composer passes them (a list of torchmetrics objects, named after their classes) or by name.
MetricsInput = Sequence[Any] | Mapping[str, Any] | None


def _named_metrics(metrics: MetricsInput, argument: str) -> dict[str, Any]:
    """``metrics`` by name: a mapping as it is; a list (Composer's form) under each object's class name."""
    if metrics is None:
        return {}
    if isinstance(metrics, Mapping):
        return dict(metrics)
    if isinstance(metrics, (str, bytes)) or not isinstance(metrics, Sequence):
        raise TypeError(f"{argument}= takes a list of metrics or a dict of name -> metric, got {metrics!r}.")
    named: dict[str, Any] = {}
    for metric in metrics:
        name = type(metric).__name__
        if name in named:
            raise ValueError(f"{argument}= holds two {name}s; pass a dict to give them their own names.")
        named[name] = metric
    return named


class HuggingFaceModel(ComposerModel):
    """Wraps ``model`` (a ``transformers.PreTrainedModel``) for the Trainer; its config travels with checkpoints. A
    :class:`~fabric.trainer.model.ComposerModel`, as in Composer (programs check registered models with it)."""

    #: Composer's flag for a model with PEFT adapters, which programs read; PEFT is not supported yet.
    using_peft = False

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        use_logits: bool = False,
        metrics: MetricsInput = None,
        eval_metrics: MetricsInput = None,
        shift_labels: bool | None = None,
        allow_embedding_resizing: bool = False,
        peft_config: Any = None,
        should_save_peft_only: bool = True,
    ) -> None:
        super().__init__()
        transformers = _transformers()
        if not isinstance(model, transformers.PreTrainedModel):
            raise TypeError(f"HuggingFaceModel wraps a transformers PreTrainedModel, got {type(model).__name__}.")
        if peft_config is not None:
            raise ValueError("HuggingFaceModel(peft_config=...): PEFT adapters are not supported yet; pass None.")
        self.model = model
        self.tokenizer = tokenizer
        _fit_embeddings_to_tokenizer(model, tokenizer, allow_embedding_resizing)
        self._tokenizer_files: dict[str, bytes] | None = None  # written once, on the first checkpoint
        #: Whether evaluation gives the metrics the logits (a tensor) instead of the model's whole output.
        self.use_logits = bool(use_logits)
        self.train_metrics = _named_metrics(metrics, "metrics")
        if eval_metrics is not None:
            self.val_metrics = _named_metrics(eval_metrics, "eval_metrics")
        elif metrics is not None:  # Composer: the training metrics, also for evaluation (the Trainer copies them)
            self.val_metrics = dict(self.train_metrics)
        else:
            self.val_metrics = {} if self.use_logits else {"loss": _output_loss}
        causal = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
        #: Whether labels are compared with the logits one position earlier (next-token prediction).
        self.shift_labels = type(model).__name__ in causal if shift_labels is None else shift_labels
        parameters = inspect.signature(model.forward).parameters.values()
        takes_any = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters)
        self._named_inputs = {parameter.name for parameter in parameters if parameter.kind not in _VARIADIC}
        self._inputs = None if takes_any else self._named_inputs
        #: The labels an evaluation batch of llm-foundry's in-context learning tasks held (Composer's attribute: its
        #: ``eval_forward`` takes them out of such a batch, and ``update_metric`` gives them to the metrics).
        self.labels: torch.Tensor | None = None

    @property
    def config(self) -> Any:
        return self.model.config

    @override
    def forward(self, batch: Any) -> Any:
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"HuggingFaceModel takes batches that map input names to tensors (input_ids, labels, ...), "
                f"got a {type(batch).__name__}."
            )
        # an in-context learning or generation batch also holds its task's fields: only the forward's named inputs
        names = self._named_inputs if EVAL_MODE in batch else self._inputs
        inputs = batch if names is None else {key: value for key, value in batch.items() if key in names}
        return self.model(**inputs)

    @override
    def loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
        if loss is None:
            keys = sorted(batch) if isinstance(batch, Mapping) else []
            raise ValueError(
                f"{type(self.model).__name__}'s forward returned no loss: the batch needs 'labels' (it has {keys})."
            )
        return loss  # type: ignore[no-any-return]

    def get_num_tokens_in_batch(self, batch: Any) -> int:
        """Real tokens: those ``attention_mask`` keeps, else non-padding ``input_ids``, else all of them."""
        if not isinstance(batch, Mapping):
            return 0
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            return int(mask.sum().item())
        input_ids = batch.get("input_ids")
        if not isinstance(input_ids, torch.Tensor):
            return 0
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return int((input_ids != pad).sum().item()) if pad is not None else int(input_ids.numel())

    @override
    def get_metrics(self, is_train: bool = False) -> Mapping[str, Any]:
        return self.train_metrics if is_train else self.val_metrics

    @override
    def eval_forward(self, batch: Any, outputs: Any | None = None) -> Any:
        """The model's output, or with ``use_logits=True`` its logits (one-column logits squeezed to a vector).

        Batches of llm-foundry's in-context learning tasks, as in Composer: ``mode="icl_task"`` gives the logits of
        every position, with the batch's ``labels`` moved to :attr:`labels` one position earlier (the last one
        ignored, -100), where the tasks' metrics index them; ``mode="generate"`` gives the text the model generates
        after each prompt (``generation_kwargs`` from the batch), its ``labels`` (the answers) moved likewise.
        """
        mode = batch.get(EVAL_MODE) if isinstance(batch, Mapping) else None
        if mode == "generate":
            return self._generated_text(batch)
        if mode == "icl_task":
            labels = batch.pop("labels")
            self.labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
        outputs = self(batch) if outputs is None else outputs
        if (not self.use_logits and mode != "icl_task") or isinstance(outputs, torch.Tensor):
            return outputs
        logits = outputs["logits"]
        return logits.squeeze(1) if logits.ndim == 2 and logits.shape[1] == 1 else logits

    def _generated_text(self, batch: Any) -> list[str]:
        """What the model generates after each prompt of a ``mode="generate"`` batch, decoded (Composer's)."""
        if self.tokenizer is None:
            raise ValueError(
                "A generation batch (mode='generate') needs the tokenizer: HuggingFaceModel(model, tokenizer=...)."
            )
        self.labels = batch.pop("labels")
        prompts = batch["input_ids"]
        # every rank steps until the longest generation ends: sharded weights are gathered by all ranks together
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        generated = self.model.generate(
            prompts,
            attention_mask=batch["attention_mask"],
            synced_gpus=distributed and torch.distributed.get_world_size() > 1,
            **batch.get("generation_kwargs", {}),
        )
        texts = self.tokenizer.batch_decode(generated[:, prompts.shape[1] :], skip_special_tokens=True)
        # a tokenizer that does not encode " a" as one token (sentencepiece) dropped the space that starts the text
        if len(self.tokenizer(" a", add_special_tokens=False)["input_ids"]) == 1:
            return list(texts)
        return [" " + text for text in texts]

    @override
    def update_metric(self, batch: Any, outputs: Any, metric: Any) -> Any:
        """Feed ``(logits, labels)`` to a metric object; for causal LMs the logits of position t meet label t+1.

        A metric with ``needs_batch`` (llm-foundry's in-context learning metrics) gets ``update(batch=, outputs=,
        labels=)`` with the labels :meth:`eval_forward` took from the batch; what it returns (its per-sample
        results) is returned, as in Composer. So does any metric of a batch whose labels were taken."""
        if getattr(metric, "needs_batch", False):
            result = metric.update(batch=batch, outputs=outputs, labels=self.labels)
            if isinstance(result, dict):  # which metric gave each sample's result, as Composer adds
                result["metric_name"] = [type(metric).__name__] * len(batch["input_ids"])
            return result
        if isinstance(batch, Mapping) and EVAL_MODE in batch:
            return metric.update(outputs, self.labels)
        logits = outputs if isinstance(outputs, torch.Tensor) else outputs["logits"]
        labels = batch["labels"]
        if self.shift_labels:
            logits, labels = logits[:, :-1], labels[:, 1:]
        metric.update(logits, labels)
        return None

    @override
    def get_extra_state(self) -> dict[str, Any]:
        """Saved with the weights, for :func:`write_huggingface_pretrained`: the config (JSON), the model's class
        and the tokenizer's ``save_pretrained`` files (name -> bytes) when there is a tokenizer."""
        extra: dict[str, Any] = {"config": self.model.config.to_json_string(use_diff=False)}
        extra["class"] = type(self.model).__name__
        if self.tokenizer is not None:
            if self._tokenizer_files is None:
                self._tokenizer_files = _saved_files(self.tokenizer)
            extra["tokenizer"] = self._tokenizer_files
        return extra

    @override
    def set_extra_state(self, state: Any) -> None:
        """A checkpoint of another model class fails here, naming both."""
        saved = state.get("class") if isinstance(state, Mapping) else None
        if saved != type(self.model).__name__:
            raise ValueError(
                f"The checkpoint holds a {saved} and this HuggingFaceModel wraps a {type(self.model).__name__}."
            )

    @staticmethod
    def hf_from_composer_checkpoint(
        checkpoint_path: str | os.PathLike[str],
        model_instantiation_class: Any = None,
        model_config_kwargs: Mapping[str, Any] | None = None,
        local_checkpoint_save_location: str | os.PathLike[str] | None = None,
        trust_remote_code: bool = False,
    ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
        """Composer's name: the model (configured as saved, ``model_config_kwargs`` set on its config) and the tokenizer
        (``None`` if none was saved) of a one-file Trainer checkpoint of a :class:`HuggingFaceModel`.

        As in Composer, the weights are not loaded: load them with ``Trainer(load_path=checkpoint_path)`` (or write a
        ``from_pretrained`` folder with :func:`write_huggingface_pretrained`). ``model_instantiation_class`` is a
        ``PreTrainedModel`` class, an ``AutoModel...`` class or its import path; by default the saved class. A URL
        (``s3://...``) is copied to ``local_checkpoint_save_location`` (default: a temporary file) and read there.
        """
        transformers = _transformers()
        with _local_file(checkpoint_path, local_checkpoint_save_location) as path, tempfile.TemporaryDirectory() as tmp:
            saved = _read_saved_model(path, Path(tmp), "nothing was loaded")
            config = saved.model_class.config_class.from_dict(json.loads(saved.config))
            for name, value in (model_config_kwargs or {}).items():
                setattr(config, name, value)
            chosen: Any = _import_class(model_instantiation_class or saved.model_class)
            is_model_class = inspect.isclass(chosen) and issubclass(chosen, transformers.PreTrainedModel)
            remote = {"trust_remote_code": trust_remote_code}
            # a PreTrainedModel class takes the config; an Auto class picks the model class for it
            model = chosen(config) if is_model_class else chosen.from_config(config, **remote)
            if not saved.tokenizer_files:
                return model, None
            for name, content in saved.tokenizer_files.items():
                (Path(tmp) / name).write_bytes(content)
            tokenizer = transformers.AutoTokenizer.from_pretrained(tmp, **remote)
        return model, tokenizer


#: The files ``save_pretrained`` writes for a model: its config, generation config and weights (one file, or
#: shards and their index). A tokenizer file may not replace them.
_MODEL_FILE = re.compile(
    r"(config|generation_config)\.json|(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?"
)


def _fit_embeddings_to_tokenizer(model: Any, tokenizer: Any, allow_resizing: bool) -> None:
    """A tokenizer with more tokens than the model's vocabulary would index past the embeddings: resize them when
    allowed (Composer's ``allow_embedding_resizing``), else refuse; fewer tokens are fine (vocabularies are often
    padded to a multiple of 64)."""
    if tokenizer is None or model.config.vocab_size >= len(tokenizer):
        return
    if not allow_resizing:
        raise ValueError(
            f"The tokenizer has {len(tokenizer)} tokens and the model's vocabulary {model.config.vocab_size}: call "
            "model.resize_token_embeddings(len(tokenizer)) first, or pass allow_embedding_resizing=True."
        )
    model.resize_token_embeddings(len(tokenizer))


def write_huggingface_pretrained(checkpoint: str | os.PathLike[str], folder: str | os.PathLike[str]) -> Path:
    """Write a one-file Trainer checkpoint of a :class:`HuggingFaceModel` as a ``from_pretrained`` folder.

    The checkpoint is read with ``torch.load(weights_only=True)``: nothing in it can run code. The model
    class must be one of ``transformers``' own. The tokenizer's files, if saved, are written beside the
    weights. The export is written into a temporary sibling folder that replaces ``folder`` once complete,
    so a failed export leaves ``folder`` as it was; of an existing ``folder`` the files that are not the
    model's are kept. Returns the folder.
    """
    out = Path(folder)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; write_huggingface_pretrained writes a folder.")
    saved = _read_saved_model(Path(checkpoint), out, "nothing was written")
    model = saved.model_class(saved.model_class.config_class.from_dict(json.loads(saved.config)))
    model.load_state_dict({name.removeprefix("model."): value for name, value in saved.weights.items()}, strict=True)
    with owned_temporary(out, directory=True) as staging:
        model.save_pretrained(staging)
        for name, content in saved.tokenizer_files.items():
            with (staging / name).open("xb") as file:  # never over a file of the model's
                file.write(content)
        _replace_folder(staging, out)
    remove_abandoned(out, kinds=("tmp", "old"))  # what killed exports left behind
    return out


@dataclass(frozen=True)
class _SavedModel:
    """What a one-file checkpoint of a :class:`HuggingFaceModel` holds."""

    weights: dict[str, torch.Tensor]
    config: str  # JSON
    model_class: Any  # a transformers PreTrainedModel class
    tokenizer_files: Mapping[str, bytes]


def _read_saved_model(path: Path, destination: Path, consequence: str) -> _SavedModel:
    """Read ``path`` safely (``weights_only``) and check it, before anything is written: its saved class is one of
    ``transformers``' own, its tokenizer files can be written into ``destination`` (a folder, or where one will be).
    Errors end with ``consequence``."""
    transformers = _transformers()
    if path.is_dir():
        raise ValueError(f"{path} is a sharded checkpoint folder; run 'fabric consolidate {path}' and pass the file.")
    weights = torch.load(path, map_location="cpu", weights_only=True)["model"]
    extra = weights.pop("_extra_state", None)
    if not isinstance(extra, Mapping) or "config" not in extra or "class" not in extra:
        raise ValueError(f"{path} holds no HuggingFaceModel: its model entry has no saved config.")
    found = getattr(transformers, extra["class"], None)
    if not (inspect.isclass(found) and issubclass(found, transformers.PreTrainedModel)):
        raise ValueError(f"{path} names the model class {extra['class']!r}, which transformers does not have.")
    tokenizer_files = extra.get("tokenizer", {})
    if not isinstance(tokenizer_files, Mapping):
        raise ValueError(
            f"{path} holds a tokenizer entry of type {type(tokenizer_files).__name__}; a HuggingFaceModel saves its "
            f"tokenizer as a dict of file name -> bytes. {consequence.capitalize()}."
        )
    name_max = _longest_file_name(destination)
    for name, content in tokenizer_files.items():
        problem = _tokenizer_file_problem(name, content, name_max)
        if problem:
            raise ValueError(f"{path} holds a tokenizer file {name!r} that {problem}; {consequence}.")
    return _SavedModel(weights, extra["config"], found, tokenizer_files)


@contextlib.contextmanager
def _local_file(path: str | os.PathLike[str], keep_at: str | os.PathLike[str] | None) -> Iterator[Path]:
    """``path`` itself when local; a URL's object copied to ``keep_at`` (kept) or to a temporary file."""
    if not is_remote(path):
        yield Path(path)
        return
    fs, inner = filesystem(path)
    if keep_at is not None:
        fs.get_file(inner, os.fspath(keep_at))
        yield Path(keep_at)
        return
    with tempfile.TemporaryDirectory() as folder:
        local = Path(folder) / "checkpoint.pt"
        fs.get_file(inner, os.fspath(local))
        yield local


def _import_class(value: Any) -> Any:
    """A class, or the class an import path (``"transformers.AutoModelForCausalLM"``, ``"module:Name"``) names."""
    if not isinstance(value, str):
        return value
    module, _, name = value.replace(":", ".").rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"model_instantiation_class={value!r} names no importable class: {error}") from error


def _tokenizer_file_problem(name: object, content: object, name_max: int) -> str | None:
    """Why ``name`` cannot be written as a tokenizer file beside the model's files, or ``None``."""
    if not isinstance(name, str) or not isinstance(content, bytes):
        return "is not a file name (str) with bytes"
    if "\0" in name:
        return "holds a NUL byte"
    if name in ("", ".", "..") or "/" in name or "\\" in name:
        return "is not a plain file name"
    if len(os.fsencode(name)) > name_max:
        return f"is longer than the file system allows ({name_max} bytes)"
    if _MODEL_FILE.fullmatch(name):
        return "is the name of one of the model's own files (config, generation config, weights)"
    return None


def _longest_file_name(folder: Path) -> int:
    """The longest file name (in bytes) the file system of ``folder`` (or its nearest existing parent) takes."""
    existing = next((path for path in (folder.absolute(), *folder.absolute().parents) if path.exists()), Path("/"))
    try:
        return os.pathconf(existing, "PC_NAME_MAX")
    except (AttributeError, OSError, ValueError):  # no pathconf (Windows), or the file system does not say
        return 255


def _replace_folder(export: Path, folder: Path) -> None:
    """Put the complete ``export`` at ``folder`` in one rename. An existing ``folder`` lends its files that are not
    the model's (hard links) to the export first, and is swapped for it."""
    if not folder.exists():
        os.replace(export, folder)
        return
    for entry in folder.iterdir():
        if not _MODEL_FILE.fullmatch(entry.name) and not (export / entry.name).exists():
            if entry.is_dir() and not entry.is_symlink():
                shutil.copytree(entry, export / entry.name, symlinks=True, copy_function=_link)
            else:
                _link(entry, export / entry.name)
    previous = temporary_sibling(folder, "old")
    os.replace(folder, previous)
    os.replace(export, folder)
    remove_temporary(previous)


def _link(source: str | os.PathLike[str], destination: str | os.PathLike[str]) -> None:
    """A hard link, or a copy where the file system has none."""
    try:
        os.link(source, destination, follow_symlinks=False)
    except OSError:
        shutil.copy2(source, destination, follow_symlinks=False)


def _saved_files(tokenizer: Any) -> dict[str, bytes]:
    """The files ``tokenizer.save_pretrained`` writes, by name."""
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        return {path.name: path.read_bytes() for path in sorted(Path(folder).iterdir()) if path.is_file()}


def _output_loss(outputs: Any, batch: Any) -> torch.Tensor:
    """The eval loss the model computed (its forward got the batch's labels)."""
    return outputs["loss"]  # type: ignore[no-any-return]


def huggingface_folder_contents(
    model_state: Mapping[str, Any], destination: Path
) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
    """The weights and the other files (name -> bytes) of a Hugging Face folder made from a checkpoint's
    ``model`` entry (read whole). A :class:`HuggingFaceModel`'s entry gives ``transformers``' names (its ``model.``
    prefix removed), ``config.json`` and the tokenizer's files; any other module's gives its tensors as named."""
    weights = dict(model_state)
    extra = weights.pop("_extra_state", None)
    files: dict[str, bytes] = {}
    if isinstance(extra, Mapping) and "config" in extra and "class" in extra:
        weights = {name.removeprefix("model."): value for name, value in weights.items()}
        files.update(config_file(extra["config"], extra["class"]))
        name_max = _longest_file_name(destination)
        for name, content in extra.get("tokenizer", {}).items():
            problem = _tokenizer_file_problem(name, content, name_max)
            if problem:
                raise ValueError(f"The checkpoint holds a tokenizer file {name!r} that {problem}.")
            files[name] = content
    elif extra is not None:
        weights["_extra_state"] = extra
    others = sorted(name for name, value in weights.items() if not isinstance(value, torch.Tensor))
    if others:
        raise ValueError(f"A Hugging Face folder holds tensors only; the checkpoint's model entry also has {others}.")
    return weights, files
