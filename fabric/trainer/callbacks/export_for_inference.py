"""``ExportForInference``: at the end of training, save the model as a TorchScript, ``torch.export`` or ONNX file."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn
from typing_extensions import override

from fabric.trainer.callbacks._utils import check_file_name, check_name, format_name, global_rank, user_model
from fabric.trainer.core.callback import Callback
from fabric.trainer.export import SAVE_FORMATS, check_save_format, export_model, on_cpu

if TYPE_CHECKING:
    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State


class ExportForInference(Callback):
    """At ``FIT_END``, rank 0 exports a CPU copy of the trained model, in eval mode, to ``save_folder/save_name``.

    ``save_format``:

    * ``"torchscript"``: ``torch.jit.script``, or where scripting fails ``torch.jit.trace`` on the sample
      input; load with ``torch.jit.load``;
    * ``"torchexport"`` (or ``"exported_program"``): ``torch.export.export`` on the sample input, saved with
      ``torch.export.save``; load with ``torch.export.load(path).module()``;
    * ``"onnx"``: ``torch.onnx.export`` (needs ``pip install onnx onnxscript``), with ``input_names`` and
      ``output_names`` when given.

    ``sample_input`` is the one argument the model's ``forward`` receives (for a Trainer model, a batch);
    without it, the first training batch as the model received it is kept (on CPU) and used.
    With ``dynamic_batch`` (the default) the first dimension of every input tensor may vary in the
    ``torch.export`` and ONNX graphs (``torch.export.Dim.AUTO``: kept static where the model needs it, as for
    a sample batch of 1). ``transforms`` are applied, in order, to the copy before exporting (each takes and
    returns a module).
    ``save_folder`` may use ``{run_name}``; the default ``save_name`` follows the format (``model.pt``,
    ``model.pt2``, ``model.onnx``). Composer's ``save_path`` (a local file path) may replace both.
    ``save_object_store`` (an upload) is not supported. The model must be whole on rank 0 (not sharded).
    The file written is in :attr:`exported_path`.
    """

    def __init__(
        self,
        save_format: str,
        *,
        save_folder: str = ".",
        save_name: str | None = None,
        sample_input: Any = None,
        save_path: str | None = None,
        transforms: Sequence[Callable[[nn.Module], nn.Module]] | None = None,
        input_names: Sequence[str] | None = None,
        output_names: Sequence[str] | None = None,
        save_object_store: object = None,
        dynamic_batch: bool = True,
    ) -> None:
        check_save_format(save_format)
        if save_object_store is not None:
            raise ValueError(
                "save_object_store is not supported: ExportForInference writes a local file; copy it from there."
            )
        if save_path is not None:
            if save_folder != "." or save_name is not None:
                raise ValueError(
                    f"Give save_path={save_path!r} or save_folder/save_name, not both "
                    f"(got save_folder={save_folder!r}, save_name={save_name!r})."
                )
            if not isinstance(save_path, str) or not save_path or "://" in save_path:
                raise ValueError(f"save_path must be a local file path; got {save_path!r}.")
            save_folder, save_name = os.path.dirname(save_path) or ".", os.path.basename(save_path)
        self.save_format = save_format
        self.save_folder = check_name(save_folder, "save_folder", ("run_name",))
        self.save_name = check_file_name(save_name or SAVE_FORMATS[save_format], "save_name")
        self.sample_input = sample_input
        self.transforms = list(transforms or ())
        if not all(callable(transform) for transform in self.transforms):
            raise ValueError(f"transforms must be callables taking and returning a module; got {transforms!r}.")
        for what, names in (("input_names", input_names), ("output_names", output_names)):
            if names is not None and (isinstance(names, str) or not all(isinstance(name, str) for name in names)):
                raise ValueError(f"{what} must be a list of strings or None; got {names!r}.")
        if not isinstance(dynamic_batch, bool):
            raise ValueError(f"dynamic_batch must be True or False; got {dynamic_batch!r}.")
        self.dynamic_batch = dynamic_batch
        self.input_names = None if input_names is None else list(input_names)
        self.output_names = None if output_names is None else list(output_names)
        #: The file written at the last FIT_END (on rank 0), or None.
        self.exported_path: str | None = None
        self._first_batch: Any = None

    @override
    def before_forward(self, state: State, logger: Logger) -> None:
        if self.sample_input is None and self._first_batch is None:
            self._first_batch = on_cpu(state.batch)

    @override
    def fit_end(self, state: State, logger: Logger) -> None:
        if global_rank(state) == 0:
            self._export(state)

    def _export(self, state: State) -> None:
        sample = self.sample_input if self.sample_input is not None else self._first_batch
        if sample is None and self.save_format != "torchscript":
            raise ValueError(
                f"ExportForInference(save_format={self.save_format!r}) needs an input to trace the model with: "
                "pass sample_input=..., or train at least one batch first."
            )
        path = os.path.join(format_name(self.save_folder, state), format_name(self.save_name, state))
        export_model(
            user_model(state), self.save_format, path, sample, self.transforms, self.input_names, self.output_names,
            self.dynamic_batch,
        )  # fmt: skip
        self.exported_path = path


#: Composer's name for this callback.
ExportForInferenceCallback = ExportForInference
