"""What fabric.setup* returns: modules, optimizers and dataloaders that behave like the user's own."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from fabric import Fabric
from fabric.plugins.precision.precision import Precision
from fabric.trainer.stages import switch_precision
from fabric.wrappers import FabricDataLoader, FabricModule, wrap_dataloader


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.flag = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def generate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        hidden = self.layer(x)
        return hidden, hidden.dtype


def test_module_state_dict_has_no_wrapper_prefix() -> None:
    model = Generator()
    wrapped = Fabric(accelerator="cpu").setup(model)
    assert list(wrapped.state_dict()) == list(model.state_dict()) == ["layer.weight", "layer.bias"]
    wrapped.load_state_dict({k: torch.zeros_like(v) for k, v in model.state_dict().items()})
    assert torch.count_nonzero(model.layer.weight) == 0


def test_module_attributes_fall_through_both_ways() -> None:
    model = Generator()
    wrapped = Fabric(accelerator="cpu").setup(model)
    assert wrapped.layer is model.layer
    assert wrapped.module is model
    wrapped.flag = True
    assert model.flag is True
    wrapped.train(False)
    assert not wrapped.training and not model.training


def test_hooks_on_the_wrapper_run_and_change_what_the_call_returns() -> None:
    """The wrapper's own call path skips ``nn.Module.__call__`` only while no hook could see the difference."""
    wrapped = Fabric(accelerator="cpu").setup(Generator())
    x = torch.randn(2, 4)
    plain = wrapped(x)
    seen: list[str] = []
    handles = [
        wrapped.register_forward_pre_hook(lambda module, args: seen.append("pre") or (args[0] * 0,)),
        wrapped.register_forward_hook(lambda module, args, output: seen.append("post") or output + 1),
        wrapped.register_full_backward_hook(lambda module, grad_in, grad_out: seen.append("backward")),
    ]
    hooked = wrapped(x.requires_grad_())
    hooked.sum().backward()
    assert seen == ["pre", "post", "backward"]
    assert torch.equal(hooked, wrapped.module.layer.bias.expand(2, 4) + 1)  # the pre-hook zeroed the input
    for handle in handles:
        handle.remove()
    assert torch.equal(wrapped(x), plain) and seen == ["pre", "post", "backward"]


@pytest.mark.parametrize(
    "register",
    [
        torch.nn.modules.module.register_module_forward_pre_hook,
        torch.nn.modules.module.register_module_forward_hook,
        torch.nn.modules.module.register_module_full_backward_pre_hook,
        torch.nn.modules.module.register_module_full_backward_hook,
    ],
)
def test_process_wide_module_hooks_see_the_wrapper_as_nn_module_call_would(register: Any) -> None:
    """Profilers and FLOP counters register hooks for every module: the wrapper is one of them, as before."""
    wrapped = Fabric(accelerator="cpu").setup(Generator())
    called: list[type[nn.Module]] = []
    handle = register(lambda module, *rest: called.append(type(module)))
    try:
        wrapped(torch.randn(2, 4, requires_grad=True)).sum().backward()
    finally:
        handle.remove()
    assert called.count(FabricModule) == 1 and called.count(Generator) == 1 and called.count(nn.Linear) == 1


def test_a_compiled_wrapper_runs_its_compiled_call() -> None:
    graphs: list[torch.fx.GraphModule] = []

    def backend(graph: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        graphs.append(graph)
        return graph.forward

    wrapped = Fabric(accelerator="cpu").setup(Generator())
    wrapped.compile(backend=backend)
    x = torch.randn(2, 4)
    assert torch.equal(wrapped(x), wrapped.module(x))
    assert len(graphs) == 1


class Outer(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.mark.filterwarnings("ignore:`torch.jit.trace")
def test_a_traced_wrapper_is_a_scope_of_the_trace_like_any_module() -> None:
    wrapped = Fabric(accelerator="cpu").setup(Generator())
    x = torch.randn(2, 4)
    traced = torch.jit.trace(Outer(wrapped), x)
    scopes = [node.scopeName() for node in traced.inlined_graph.nodes() if node.kind() == "aten::linear"]
    assert scopes == ["__module.inner/__module.inner._forward_module/__module.inner._forward_module.layer"]
    assert torch.allclose(traced(x), wrapped(x))


def test_marked_forward_method_runs_under_the_precision() -> None:
    fabric = Fabric(accelerator="cpu", precision="bf16-mixed")
    wrapped = fabric.setup(Generator())
    _, dtype_unmarked = wrapped.generate(torch.randn(2, 4))
    assert dtype_unmarked == torch.float32
    wrapped.mark_forward_method("generate")
    output, dtype_marked = wrapped.generate(torch.randn(2, 4))
    assert dtype_marked == torch.bfloat16
    assert output.dtype == torch.float32  # converted back for the user


def test_marking_a_missing_method_is_an_error() -> None:
    wrapped = Fabric(accelerator="cpu").setup(Generator())
    with pytest.raises(AttributeError, match="no method 'sample'"):
        wrapped.mark_forward_method("sample")


def test_wrapped_optimizer_is_the_users_optimizer_class_and_shares_its_state() -> None:
    model = nn.Linear(3, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    fabric = Fabric(accelerator="cpu")
    wrapped_model, wrapped = fabric.setup(model, optimizer)
    assert isinstance(wrapped, torch.optim.Adam)
    assert wrapped.param_groups is optimizer.param_groups
    fabric.backward(wrapped_model(torch.randn(4, 3)).sum())
    wrapped.step()
    assert wrapped.state is optimizer.state and len(optimizer.state) == 2
    wrapped.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_lr_scheduler_accepts_the_wrapped_optimizer_without_step_order_warnings() -> None:
    model = nn.Linear(3, 1)
    fabric = Fabric(accelerator="cpu")
    wrapped_model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            fabric.backward(wrapped_model(torch.randn(2, 3)).sum())
            optimizer.step()
            scheduler.step()
    assert optimizer.optimizer.param_groups[0]["lr"] == pytest.approx(0.125)


class _CountingPrecision(Precision):
    """A precision plugin that changes how optimizers step (as a GradScaler's does): it counts the steps."""

    def __init__(self) -> None:
        self.steps = 0

    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
        self.steps += 1
        return super().optimizer_step(optimizer, closure)


@pytest.mark.parametrize("built", ["before setup", "after setup"])
def test_the_step_of_an_optimizer_with_a_scheduler_goes_through_the_strategy(built: str) -> None:
    """A scheduler built before setup stored its own ``step`` on the optimizer, which the wrapper shares:
    ``optimizer.step()`` then stepped the user's optimizer directly, past DeepSpeed's engine or a GradScaler."""
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    fabric = Fabric(accelerator="cpu")
    counting = _CountingPrecision()  # steps the way a GradScaler does: through the strategy, then the precision
    switch_precision(fabric, counting)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5) if built == "before setup" else None
    wrapped_model, wrapped = fabric.setup(model, optimizer)
    scheduler = scheduler or torch.optim.lr_scheduler.StepLR(wrapped, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor a "scheduler.step() before optimizer.step()" warning
        for _ in range(3):
            fabric.backward(wrapped_model(torch.randn(2, 3)).sum())
            wrapped.step()
            scheduler.step()
    assert counting.steps == 3
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.125)


def test_the_step_follows_a_precision_that_was_swapped_in_after_setup() -> None:
    """The wrapper steps the optimizer itself only while neither the strategy nor the precision changes how it steps,
    and it decides at every call: a precision set after setup (as the Trainer's ``fit(precision=)`` does) is obeyed."""
    model = nn.Linear(3, 1)
    fabric = Fabric(accelerator="cpu")
    wrapped_model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    fabric.backward(wrapped_model(torch.randn(2, 3)).sum())
    optimizer.step()  # the plain precision: the optimizer steps, nothing counted
    counting = _CountingPrecision()
    switch_precision(fabric, counting)  # what the Trainer's fit(precision=...) does
    before = model.weight.detach().clone()
    fabric.backward(wrapped_model(torch.randn(2, 3)).sum())
    optimizer.step()
    optimizer.step(lambda: None)
    assert counting.steps == 2
    assert not torch.equal(model.weight.detach(), before)


def test_wrapped_optimizer_state_dict_round_trip_reaches_the_original() -> None:
    model = nn.Linear(3, 1)
    fabric = Fabric(accelerator="cpu")
    wrapped_model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.1))
    fabric.backward(wrapped_model(torch.randn(2, 3)).sum())
    optimizer.step()
    saved = optimizer.state_dict()
    fresh_model = nn.Linear(3, 1)
    fresh = torch.optim.Adam(fresh_model.parameters(), lr=0.1)
    _, fresh_wrapped = fabric.setup(fresh_model, fresh)
    fresh_wrapped.load_state_dict(saved)
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], saved["state"][0]["exp_avg"])


@dataclass
class Batch:
    inputs: torch.Tensor
    label: int


def _identity(batch: list[Any]) -> Any:
    return batch[0]


def test_dataloader_wrapper_moves_tensors_inside_collections() -> None:
    samples = [(torch.ones(2), {"mask": torch.zeros(2), "name": "a"}, Batch(torch.ones(1), 3))]
    loader = wrap_dataloader(DataLoader(samples, batch_size=1, collate_fn=_identity), torch.device("meta"))
    (moved,) = list(loader)
    assert moved[0].device.type == "meta"
    assert moved[1]["mask"].device.type == "meta" and moved[1]["name"] == "a"
    assert moved[2].inputs.device.type == "meta" and moved[2].label == 3


class MyLoader(DataLoader):  # type: ignore[type-arg]
    """A user subclass with a constructor of its own."""

    def __init__(self, data: TensorDataset, note: str) -> None:
        super().__init__(data, batch_size=4)
        self.note = note


def test_wrapped_dataloader_is_still_the_users_class_and_leaves_the_original_alone() -> None:
    original = MyLoader(TensorDataset(torch.arange(10.0)), note="mine")
    loader = Fabric(accelerator="cpu").setup_dataloaders(original)
    assert isinstance(loader, MyLoader) and isinstance(loader, DataLoader)
    assert loader.note == "mine" and loader.batch_size == 4 and len(loader) == 3
    assert [batch[0].tolist() for batch in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert not isinstance(original, FabricDataLoader)


def test_fabric_save_of_a_set_up_loader_pickles_it_and_load_gives_back_a_set_up_loader(tmp_path: Path) -> None:
    """litgpt saves ``{"model", "optimizer", "train_dataloader", "iter_num", ...}``; a loader without
    ``state_dict()`` is pickled, as Lightning does, and comes back set up, where it was in its epochs."""
    fabric = Fabric(accelerator="cpu")
    loader = fabric.setup_dataloaders(MyLoader(TensorDataset(torch.arange(10.0)), note="mine"))
    list(loader)
    fabric.save(tmp_path / "state.ckpt", {"train_dataloader": loader, "iter_num": 3})
    state: dict[str, Any] = {"train_dataloader": None, "iter_num": 0}
    assert fabric.load(tmp_path / "state.ckpt", state, weights_only=False) == {}
    restored = state["train_dataloader"]
    assert isinstance(restored, FabricDataLoader) and isinstance(restored, MyLoader) and restored.note == "mine"
    assert restored._fabric_epoch == 1 and state["iter_num"] == 3
    assert [batch[0].tolist() for batch in restored] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    raw = fabric.load(tmp_path / "state.ckpt", weights_only=False)
    assert isinstance(raw["train_dataloader"], MyLoader) and raw["train_dataloader"].note == "mine"


def test_a_checkpoint_holding_a_set_up_loader_resumes_with_the_safe_default_and_keeps_the_live_loader(
    tmp_path: Path,
) -> None:
    """litgpt's ``pretrain --resume`` loads ``{"train_dataloader": loader, ...}`` with the default weights_only=True:
    under Lightning that crashes on the pickled loader. The loader is kept opaque in the file, so the safe load works,
    the program's own loader stays in place, and a loader read without a live one says how to get it."""
    fabric = Fabric(accelerator="cpu")
    loader = fabric.setup_dataloaders(MyLoader(TensorDataset(torch.arange(10.0)), note="mine"))
    fabric.save(tmp_path / "state.ckpt", {"train_dataloader": loader, "iter_num": 3})
    live = fabric.setup_dataloaders(MyLoader(TensorDataset(torch.arange(4.0)), note="live"))
    state: dict[str, Any] = {"train_dataloader": live, "iter_num": 0}
    assert fabric.load(tmp_path / "state.ckpt", state) == {}
    assert state["train_dataloader"] is live and state["iter_num"] == 3
    saved = fabric.load(tmp_path / "state.ckpt")["train_dataloader"]
    with pytest.raises(TypeError, match=r"saved pickled and loaded with weights_only=True.*weights_only=False"):
        iter(saved)
    assert [batch[0].tolist() for batch in saved.rebuild()] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


class ResumableLoader(DataLoader):  # type: ignore[type-arg]
    """A loader that knows where it is (as litdata's and torchdata's stateful loaders do)."""

    position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def test_fabric_save_of_a_set_up_loader_with_state_dict_saves_its_state(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu")
    loader = fabric.setup_dataloaders(ResumableLoader(list(range(4))))
    loader.position = 5
    fabric.save(tmp_path / "state.ckpt", {"loader": loader})
    assert torch.load(tmp_path / "state.ckpt")["loader"] == {"position": 5}  # safe to load: no pickled object
    fresh = fabric.setup_dataloaders(ResumableLoader(list(range(4))))
    fabric.load(tmp_path / "state.ckpt", {"loader": fresh})
    assert fresh.position == 5


def test_setup_dataloaders_returns_one_per_input_and_rejects_other_iterables() -> None:
    fabric = Fabric(accelerator="cpu")
    first, second = fabric.setup_dataloaders(DataLoader([1]), DataLoader([2]))
    assert [int(b) for b in first] == [1] and [int(b) for b in second] == [2]
    with pytest.raises(ValueError, match="already set up"):
        fabric.setup_dataloaders(first)
    with pytest.raises(TypeError, match=r"expects torch\.utils\.data\.DataLoader objects, got list"):
        fabric.setup_dataloaders([1, 2])  # type: ignore[arg-type]


def test_setting_up_twice_or_with_wrong_types_is_an_error() -> None:
    fabric = Fabric(accelerator="cpu")
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped_model, wrapped_optimizer = fabric.setup(model, optimizer)
    assert isinstance(wrapped_model, FabricModule)
    with pytest.raises(ValueError, match="already set up"):
        fabric.setup(wrapped_model)
    with pytest.raises(ValueError, match="already set up"):
        fabric.setup_optimizers(wrapped_optimizer)
    with pytest.raises(TypeError, match=r"expects an nn\.Module"):
        fabric.setup("model")  # type: ignore[call-overload]


def test_a_set_up_sequential_indexes_iterates_and_has_the_length_of_the_module_it_wraps() -> None:
    """``model[0]`` failed with "'FabricModule' object is not subscriptable" and no hint."""
    layers = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    model = Fabric(accelerator="cpu", devices=1).setup_module(layers)
    assert model[0] is layers[0] and list(model[1:]) == list(layers[1:])
    assert [type(layer).__name__ for layer in model] == ["Linear", "ReLU", "Linear"]
    assert len(model) == 3 and bool(model)
    single = Fabric(accelerator="cpu", devices=1).setup_module(nn.Linear(2, 3))
    assert bool(single)  # truthy although a Linear has no length
    with pytest.raises(TypeError, match=r"'Linear' object is not subscriptable \(FabricModule indexes .*model.module"):
        single[0]
    with pytest.raises(TypeError, match=r"has no len\(\) \(FabricModule measures the module it wraps, `model.module`"):
        len(single)
