"""Model surgery: module replacement, optimizer re-pointing, and replaying surgery when loading a checkpoint."""

from __future__ import annotations

import io
from types import ModuleType

import pytest
import torch
from torch import nn

from fabric.trainer.algorithms import (
    BlurPool,
    ChannelsLast,
    Factorize,
    GhostBatchNorm,
    StochasticDepth,
    WeightStandardization,
)
from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.engine import Engine
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time
from fabric.trainer.surgery import (
    reapply_surgery,
    replace_modules,
    surgery_records,
    update_params_in_optimizer,
)


class Doubled(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.inner(x)


class LinearSubclass(nn.Linear):
    pass


def test_replace_modules_matches_the_exact_class_and_reports_what_it_replaced() -> None:
    model = nn.Sequential(nn.Linear(2, 2), LinearSubclass(2, 2), nn.Sequential(nn.ReLU(), nn.Linear(2, 2)))
    originals = [model[0], model[2][1]]
    replaced = replace_modules(model, {nn.Linear: lambda module, name: Doubled(module)})
    assert list(replaced) == ["0", "2.1"]
    assert [original for original, _ in replaced.values()] == originals
    assert isinstance(model[0], Doubled) and isinstance(model[2][1], Doubled)
    assert type(model[1]) is LinearSubclass  # a subclass may behave differently: not touched
    assert model[0].inner is originals[0]  # the replacement is not searched again


def test_a_factory_returning_none_keeps_the_module() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 3))
    replaced = replace_modules(model, {nn.Linear: lambda module, name: None if name == "0" else nn.Identity()})
    assert list(replaced) == ["1"] and type(model[0]) is nn.Linear and type(model[1]) is nn.Identity


def test_a_module_reachable_twice_gets_one_replacement_and_the_root_is_never_replaced() -> None:
    shared = nn.Linear(2, 2)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    calls = []

    def factory(module: nn.Module, name: str) -> nn.Module:
        calls.append(name)
        return Doubled(module)

    replace_modules(model, {nn.Linear: factory, nn.Sequential: factory})
    assert calls == ["0"]
    assert model[0] is model[2] and isinstance(model[0], Doubled) and isinstance(model, nn.Sequential)


def test_modules_inside_a_replaced_module_are_left_alone() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)))
    replaced = replace_modules(model, {nn.Sequential: lambda m, n: Doubled(m), nn.Linear: lambda m, n: nn.Identity()})
    assert list(replaced) == ["0"] and type(model[0].inner[0]) is nn.Linear


def test_new_parameters_join_the_group_of_the_old_ones_and_old_state_is_dropped() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    optimizer = torch.optim.Adam(
        [{"params": model[0].parameters()}, {"params": model[1].parameters(), "weight_decay": 0.5}]
    )
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    old = list(model[1].parameters())
    replacement = nn.Linear(2, 2)
    new = [model[1].weight, replacement.bias]  # the weight is kept, the bias is new
    update_params_in_optimizer(old, new, [optimizer])
    first, second = optimizer.param_groups
    assert [id(p) for p in first["params"]] == [id(p) for p in model[0].parameters()]
    assert [id(p) for p in second["params"]] == [id(model[1].weight), id(replacement.bias)]
    assert model[1].weight in optimizer.state and model[1].bias not in optimizer.state  # kept state stays


def test_parameters_of_a_module_no_optimizer_holds_are_not_added() -> None:
    frozen, trained = nn.Linear(2, 2), nn.Linear(2, 2)
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
    update_params_in_optimizer(list(frozen.parameters()), list(nn.Linear(2, 2).parameters()), [optimizer])
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in trained.parameters()]


def test_surgery_at_init_re_points_the_users_optimizer_so_the_new_layers_train() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = State(model=model, max_duration=Time.from_timestring("1ep"), optimizers=[optimizer])
    Engine(state, None, [Factorize(min_features=4, latent_features=2)]).run_event(Event.INIT)
    held = {id(p) for p in optimizer.param_groups[0]["params"]}
    assert held == {id(p) for p in model.parameters()}  # exactly the factorized model's parameters
    before = model[0].first.weight.detach().clone()
    model(torch.randn(8, 16)).pow(2).sum().backward()
    optimizer.step()
    assert not torch.equal(model[0].first.weight, before)


def _structural_algorithms(image_task: ModuleType) -> list[Algorithm]:
    return [
        BlurPool(min_channels=8),
        GhostBatchNorm(ghost_batch_size=4),
        StochasticDepth(image_task.ResidualBlock, "branch", drop_rate=0.5, drop_warmup="0.5dur"),
        Factorize(min_channels=8, latent_channels=0.5, min_features=4, latent_features=0.5),
        WeightStandardization(n_last_layers_ignore=1),
    ]


def test_a_checkpoint_saved_after_surgery_loads_into_a_fresh_model_through_reapply_surgery(
    image_task: ModuleType,
) -> None:
    torch.manual_seed(0)
    model = image_task.SmallResNet(width=8)
    algorithms = _structural_algorithms(image_task)
    state = State(model=model, max_duration=Time.from_timestring("1ep"))
    Engine(state, None, algorithms).run_event(Event.INIT)
    model(torch.randn(16, 3, 16, 16))  # a training step's forward: BatchNorm statistics move
    depth = next(algorithm for algorithm in algorithms if isinstance(algorithm, StochasticDepth))
    depth.set_warmup_progress(0.5)  # mid-warmup: the rates in force are not the targets
    model.eval()
    images = torch.randn(4, 3, 16, 16)
    expected = model(images)

    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "surgery": surgery_records(algorithms)}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)  # the records are plain data
    assert [record["algorithm"].rsplit(".", 1)[1] for record in checkpoint["surgery"]] == [
        "BlurPool",
        "GhostBatchNorm",
        "StochasticDepth",
        "Factorize",
        "WeightStandardization",
    ]

    fresh = image_task.SmallResNet(width=8)
    with pytest.raises(RuntimeError, match="Missing key"):
        fresh.load_state_dict(checkpoint["model"])
    rebuilt = reapply_surgery(fresh, checkpoint["surgery"])
    assert [type(algorithm) for algorithm in rebuilt] == [type(a) for a in algorithms if type(a) is not ChannelsLast]
    fresh.load_state_dict(checkpoint["model"])
    fresh.eval()
    assert torch.equal(fresh(images), expected)
    assert str(fresh) == str(model)


def test_memory_format_changes_are_not_recorded_as_structural() -> None:
    assert not ChannelsLast.changes_module_structure
    assert surgery_records([ChannelsLast(), GhostBatchNorm(8)]) == [
        {"algorithm": "fabric.trainer.algorithms.ghost_batchnorm.GhostBatchNorm", "hparams": {"ghost_batch_size": 8}}
    ]


def test_reapply_surgery_skips_algorithms_the_run_already_applied(image_task: ModuleType) -> None:
    records = surgery_records([GhostBatchNorm(ghost_batch_size=4), BlurPool(min_channels=8)])
    model = image_task.SmallResNet(width=8)
    own = GhostBatchNorm(ghost_batch_size=4)
    own.apply_surgery(model)
    rebuilt = reapply_surgery(model, records, already_applied=[own])
    assert [type(algorithm) for algorithm in rebuilt] == [BlurPool]
    assert records[0]["hparams"] == {"ghost_batch_size": 4}


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("fabric.trainer.algorithms.nonexistent.Thing", "cannot be imported"),
        ("torch.nn.Linear", "is not a SurgeryAlgorithm"),
    ],
)
def test_a_record_naming_something_other_than_a_surgery_algorithm_is_rejected(path: str, reason: str) -> None:
    with pytest.raises(ValueError, match=f"{path!r}, which {reason}"):
        reapply_surgery(nn.Linear(1, 1), [{"algorithm": path, "hparams": {}}])
