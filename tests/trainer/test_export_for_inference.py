"""ExportForInference: the exported file loads and computes what the trained model computes."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from monitor_rig import Regressor, Rig, fit
from torch import nn
from torch.export import Dim

from fabric.trainer.callbacks import ExportForInference, ExportForInferenceCallback
from fabric.trainer.core.events import Event

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")

BATCH = (torch.randn(5, 3, generator=torch.Generator().manual_seed(1)), torch.zeros(5, 1))


def _expected(model: nn.Module, batch: Any) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        outputs: torch.Tensor = model(batch)
    return outputs


class Unscriptable(Regressor):
    def forward(self, batch: Any) -> torch.Tensor:  # TorchScript cannot index an Any
        outputs: torch.Tensor = self.net(batch[0])
        return outputs


@pytest.mark.parametrize(("model_class", "how"), [(Regressor, "script"), (Unscriptable, "trace")])
def test_torchscript_loads_and_matches_the_trained_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, model_class: type[nn.Module], how: str
) -> None:
    traced: list[Any] = []
    trace = torch.jit.trace
    monkeypatch.setattr(torch.jit, "trace", lambda model, args: traced.append(args) or trace(model, args))
    model = model_class()
    export = ExportForInference("torchscript", save_folder=str(tmp_path / "{run_name}"))
    memory = fit(model, [export], run_name="exported")
    assert export.exported_path == str(tmp_path / "exported" / "model.pt")
    loaded = torch.jit.load(export.exported_path)
    torch.testing.assert_close(loaded(BATCH), _expected(model, BATCH))
    if how == "trace":  # on the first training batch, as the model received it
        ((first_batch,),) = traced
        assert isinstance(first_batch, list | tuple) and first_batch[0].shape == (8, 3)
    else:
        assert traced == []
    assert len(memory.data["loss/train/total"]) == 6


def test_torchscript_scripts_a_scriptable_model_without_any_input(tmp_path: Any) -> None:
    class Clipped(nn.Module):  # data-dependent control flow: scripting keeps it, tracing would not
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.linear(x)
            if bool(y.sum() > 0):
                return y
            return -y

    model = Clipped()
    export = ExportForInference("torchscript", save_path=str(tmp_path / "clipped.ts"))
    Rig(export, model=model).run(Event.FIT_END)
    loaded = torch.jit.load(str(tmp_path / "clipped.ts"))
    for x in (torch.ones(2, 3), -torch.ones(2, 3) * 100):
        torch.testing.assert_close(loaded(x), _expected(model, x))


@pytest.mark.parametrize("save_format", ["torchexport", "exported_program"])
def test_torch_export_with_a_sample_input_loads_and_matches(tmp_path: Any, save_format: str) -> None:
    model = Regressor()
    export = ExportForInference(save_format, save_folder=str(tmp_path), sample_input=BATCH)
    fit(model, [export], max_duration="1ep")
    assert export.exported_path == str(tmp_path / "model.pt2")
    program = torch.export.load(export.exported_path)
    for rows in (5, 2, 17):  # the batch dimension is free
        other = (torch.randn(rows, 3), torch.zeros(rows, 1))
        torch.testing.assert_close(program.module()(other), _expected(model, other))


def test_torch_export_without_dynamic_batch_keeps_the_samples_shape(tmp_path: Any) -> None:
    model = nn.Linear(3, 1)
    export = ExportForInference(
        "torchexport", save_folder=str(tmp_path), sample_input=torch.ones(2, 3), dynamic_batch=False
    )
    Rig(export, model=model).run(Event.FIT_END)
    program = torch.export.load(str(tmp_path / "model.pt2")).module()
    torch.testing.assert_close(program(torch.ones(2, 3)), _expected(model, torch.ones(2, 3)))
    with pytest.raises(AssertionError, match="Guard failed"):
        program(torch.ones(4, 3))


def test_transforms_change_the_exported_copy_not_the_model(tmp_path: Any) -> None:
    model = nn.Linear(3, 1)
    halve = nn.Linear(1, 1, bias=False)
    nn.init.constant_(halve.weight, 0.5)
    export = ExportForInference(
        "torchexport",
        save_folder=str(tmp_path),
        sample_input=torch.ones(2, 3),
        transforms=[lambda m: nn.Sequential(m, halve)],
    )
    Rig(export, model=model).run(Event.FIT_END)
    x = torch.randn(4, 3)
    torch.testing.assert_close(torch.export.load(str(tmp_path / "model.pt2")).module()(x), _expected(model, x) / 2)
    assert isinstance(model, nn.Linear) and model.training is False  # _expected set eval; the model is unchanged


def test_only_rank_zero_exports(tmp_path: Any) -> None:
    export = ExportForInference("torchscript", save_folder=str(tmp_path))
    fabric = SimpleNamespace(device=torch.device("cpu"), global_rank=1, world_size=2)
    Rig(export, model=nn.Linear(3, 1), fabric=fabric).run(Event.FIT_END)
    assert export.exported_path is None and list(tmp_path.iterdir()) == []


def test_tracing_formats_need_an_input(tmp_path: Any) -> None:
    rig = Rig(ExportForInference("torchexport", save_folder=str(tmp_path)), model=nn.Linear(3, 1))
    with pytest.raises(ValueError, match="needs an input to trace the model with: pass sample_input"):
        rig.run(Event.FIT_END)


@pytest.mark.parametrize(
    ("missing", "message"),
    [
        (("onnxscript",), "needs onnxscript, which is not installed: pip install onnx onnxscript"),
        (("onnx", "onnxscript"), "needs onnx and onnxscript, which are not installed: pip install onnx onnxscript"),
    ],
)
def test_onnx_is_refused_at_construction_without_its_packages(
    monkeypatch: pytest.MonkeyPatch, missing: tuple[str, ...], message: str
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else SimpleNamespace())
    with pytest.raises(ModuleNotFoundError, match=message):
        ExportForInference("onnx", sample_input=torch.ones(1, 3))


def test_onnx_exports_a_cpu_eval_copy_with_the_names_given(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: SimpleNamespace(name=name))  # both installed
    calls: list[tuple[Any, ...]] = []

    def export(model: nn.Module, args: tuple[Any, ...], path: str, **options: Any) -> None:
        calls.append((model, args, path, options))
        with open(path, "wb") as file:
            file.write(b"onnx")

    monkeypatch.setattr(torch.onnx, "export", export)
    model = nn.Linear(3, 1)
    callback = ExportForInference(
        "onnx", save_folder=str(tmp_path), sample_input=torch.ones(1, 3), input_names=["x"], output_names=["y"]
    )
    Rig(callback, model=model).run(Event.FIT_END)
    ((exported, args, path, options),) = calls
    assert exported is not model and not exported.training
    torch.testing.assert_close(exported.weight, model.weight)
    torch.testing.assert_close(args, (torch.ones(1, 3),))
    assert path == str(tmp_path / "model.onnx") == callback.exported_path
    assert options == {"input_names": ["x"], "output_names": ["y"], "dynamo": True, "dynamic_shapes": ({0: Dim.AUTO},)}


def test_onnx_for_real_where_installed(tmp_path: Any) -> None:
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    onnxruntime = pytest.importorskip("onnxruntime")
    model, x = nn.Linear(3, 2), torch.randn(4, 3)
    callback = ExportForInference("onnx", save_folder=str(tmp_path), sample_input=x, input_names=["x"])
    Rig(callback, model=model).run(Event.FIT_END)
    assert callback.exported_path is not None
    session = onnxruntime.InferenceSession(callback.exported_path)
    (outputs,) = session.run(None, {"x": x.numpy()})
    torch.testing.assert_close(torch.from_numpy(outputs), _expected(model, x))


def test_composers_name_and_save_path_work(tmp_path: Any) -> None:
    export = ExportForInferenceCallback(save_format="torchscript", save_path=str(tmp_path / "sub" / "m.pt"))
    assert (export.save_folder, export.save_name) == (str(tmp_path / "sub"), "m.pt")


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"save_format": "tflite"}, r"save_format='tflite' is not supported; accepted: \['torchscript', 'torchexport'"),
        ({"save_format": "torchscript", "save_path": "a.pt", "save_name": "b.pt"}, "Give save_path='a.pt' or"),
        ({"save_format": "torchscript", "save_path": "s3://bucket/m.pt"}, "save_path must be a local file path"),
        ({"save_format": "torchscript", "save_object_store": object()}, "save_object_store is not supported"),
        ({"save_format": "torchscript", "save_name": "a/b.pt"}, "must be a file name without folders"),
        ({"save_format": "torchscript", "save_folder": "{rank}"}, r"save_folder='{rank}' uses \['rank'\]"),
        ({"save_format": "torchscript", "transforms": ["halve"]}, "transforms must be callables"),
        ({"save_format": "torchscript", "input_names": "x"}, "input_names must be a list of strings"),
        ({"save_format": "torchexport", "dynamic_batch": 0}, "dynamic_batch must be True or False; got 0"),
    ],
)
def test_rejects_bad_arguments(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ExportForInference(**arguments)


def test_later_arguments_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        ExportForInference("torchscript", "/tmp/model.pt")  # type: ignore[misc]  # Composer's second argument


def test_composers_export_for_inference_function_and_trainer_method_write_files_that_reload(tmp_path: Any) -> None:
    """Composer's tutorials export with ``export_for_inference(...)`` and ``trainer.export_for_inference(...)``."""
    from torch.utils.data import DataLoader, TensorDataset

    from fabric.trainer import Trainer
    from fabric.trainer.export import export_for_inference

    model = Regressor()
    x = torch.randn(16, 3, generator=torch.Generator().manual_seed(0))
    trainer = Trainer(model=model, train_dataloader=DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4),
                      max_duration="1ep", progress_bar=False)  # fmt: skip
    trainer.fit()
    trainer.export_for_inference("torchexport", str(tmp_path / "trainer" / "model.pt2"), sample_input=BATCH)
    reloaded = torch.export.load(str(tmp_path / "trainer" / "model.pt2")).module()
    torch.testing.assert_close(reloaded(BATCH), _expected(model, BATCH))

    export_for_inference(model, "torchscript", str(tmp_path / "model.pt"))
    torch.testing.assert_close(torch.jit.load(str(tmp_path / "model.pt"))(BATCH), _expected(model, BATCH))
    with pytest.raises(ValueError, match=r"export_for_inference\(surgery_algs=...\) is not supported here: apply"):
        export_for_inference(model, "torchscript", str(tmp_path / "other.pt"), surgery_algs=["x"])
    with pytest.raises(ValueError, match=r"save_format='torchexport' needs an input to trace the model with"):
        export_for_inference(model, "torchexport", str(tmp_path / "other.pt2"))
    with pytest.raises(ValueError, match=r"save_format='savedmodel' is not supported; accepted: \['torchscript'"):
        export_for_inference(model, "savedmodel", str(tmp_path / "other"))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.pt", "trainer"]
