"""Exporting a model for inference: a TorchScript, ``torch.export`` or ONNX file of a CPU copy in eval mode.

:func:`export_for_inference` is Composer's function of that name (``composer.utils.export_for_inference``);
``Trainer.export_for_inference`` and the :class:`~fabric.trainer.callbacks.ExportForInference` callback use the
same :func:`export_model`.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

#: The accepted ``save_format`` values and the default file name of each.
SAVE_FORMATS = {
    "torchscript": "model.pt",
    "torchexport": "model.pt2",
    "exported_program": "model.pt2",
    "onnx": "model.onnx",
}
#: What ``save_format='onnx'`` needs besides torch (its exporter builds the graph with onnxscript).
_ONNX_PACKAGES = ("onnx", "onnxscript")

Transform = Callable[[nn.Module], nn.Module]


def check_save_format(save_format: str) -> None:
    """Refuse an unknown format, and ONNX without its packages, before anything is done."""
    if save_format not in SAVE_FORMATS:
        raise ValueError(f"save_format={save_format!r} is not supported; accepted: {list(SAVE_FORMATS)}.")
    if save_format == "onnx":
        missing = [package for package in _ONNX_PACKAGES if importlib.util.find_spec(package) is None]
        if missing:
            raise ModuleNotFoundError(
                f"save_format='onnx' needs {' and '.join(missing)}, which "
                f"{'is' if len(missing) == 1 else 'are'} not installed: pip install {' '.join(_ONNX_PACKAGES)}"
            )


def export_model(
    model: nn.Module,
    save_format: str,
    path: str,
    sample_input: Any = None,
    transforms: Sequence[Transform] = (),
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    dynamic_batch: bool = True,
) -> None:
    """Write a CPU copy of ``model`` in eval mode, after ``transforms``, to the local file ``path``.

    ``sample_input`` is the one argument ``forward`` takes (a Trainer model's batch); TorchScript needs it only
    where scripting fails and the model is traced instead. With ``dynamic_batch`` the first dimension of every input
    tensor may vary in ``torch.export`` and ONNX graphs.
    """
    check_save_format(save_format)
    args = None if sample_input is None else (on_cpu(sample_input),)
    if args is None and save_format != "torchscript":
        raise ValueError(
            f"Exporting with save_format={save_format!r} needs an input to trace the model with: pass sample_input=..."
        )
    exported = copy.deepcopy(model).to("cpu").eval()
    for transform in transforms:
        exported = transform(exported)
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with torch.no_grad():
        if save_format == "torchscript":
            _save_torchscript(exported, args, path)
            return
        assert args is not None
        shapes = _batch_dimension_free(args) if dynamic_batch else None
        if save_format == "onnx":
            names: dict[str, Any] = {"input_names": input_names, "output_names": output_names}
            torch.onnx.export(exported, args, path, dynamic_shapes=shapes, dynamo=True, **names)
        else:
            torch.export.save(torch.export.export(exported, args, dynamic_shapes=shapes), path)


def export_for_inference(
    model: nn.Module,
    save_format: str,
    save_path: str,
    save_object_store: object = None,
    sample_input: Any = None,
    dynamic_axes: object = None,
    surgery_algs: object = None,
    transforms: Sequence[Transform] | None = None,
    onnx_opset_version: object = None,
    load_path: object = None,
    load_object_store: object = None,
    load_strict: bool = False,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
) -> None:
    """Composer's ``export_for_inference``: export ``model`` to the local file ``save_path`` (see :func:`export_model`).

    Composer's arguments that have no counterpart here are refused by name when given: ``save_object_store`` and
    ``load_object_store`` (copy the file yourself), ``surgery_algs`` (apply them to the model, or pass them as
    ``transforms``), ``load_path`` (``fabric.load`` the weights first), ``dynamic_axes`` and ``onnx_opset_version``
    (the batch dimension is dynamic; the exporter picks the opset).
    """
    unsupported = {
        "save_object_store": (save_object_store, "copy the exported file to the store yourself"),
        "load_object_store": (load_object_store, "load the weights into the model before exporting"),
        "surgery_algs": (surgery_algs, "apply them to the model first, or pass them as transforms"),
        "load_path": (load_path, "load the weights into the model first (fabric.load or load_state_dict)"),
        "dynamic_axes": (dynamic_axes, "the first dimension of every input is dynamic already"),
        "onnx_opset_version": (onnx_opset_version, "torch's ONNX exporter picks the opset"),
    }
    for name, (value, instead) in unsupported.items():
        if value is not None:
            raise ValueError(f"export_for_inference({name}=...) is not supported here: {instead}.")
    if not isinstance(save_path, str) or not save_path or "://" in save_path:
        raise ValueError(f"save_path must be a local file path; got {save_path!r}.")
    del load_strict  # meaningful only with load_path
    export_model(model, save_format, save_path, sample_input, list(transforms or ()), input_names, output_names)


def _save_torchscript(model: nn.Module, args: tuple[Any, ...] | None, path: str) -> None:
    """Script the model (keeps its control flow); where TorchScript cannot compile it, trace it on ``args``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.jit.* is deprecated", category=DeprecationWarning)
        try:
            exported: Any = torch.jit.script(model)
        except Exception as error:
            if args is None:
                raise ValueError(
                    f"torch.jit.script cannot compile {type(model).__name__} ({error}), and tracing it needs an "
                    "input: pass sample_input=..."
                ) from error
            exported = torch.jit.trace(model, args)  # type: ignore[no-untyped-call]
        torch.jit.save(exported, path)


def _batch_dimension_free(args: tuple[Any, ...]) -> Any:
    """``dynamic_shapes`` for ``args``: dimension 0 of every tensor left to ``torch.export`` (``Dim.AUTO``)."""
    from torch.export import Dim
    from torch.utils._pytree import tree_map

    return tree_map(lambda leaf: {0: Dim.AUTO} if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else None, args)


def on_cpu(value: Any) -> Any:
    """``value`` with every tensor in it detached and copied to the CPU."""
    return apply_to_collection(value, torch.Tensor, lambda tensor: tensor.detach().to("cpu", copy=True))
