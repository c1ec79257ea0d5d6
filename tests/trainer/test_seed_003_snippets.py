"""Seed 003 (Composer's "Using the Trainer" page): its code snippets run as written, with only Composer's names
changed (issue 28), and do what the page says.

Names changed, and nothing else: ``composer`` -> ``fabric.trainer`` (``Trainer``, and ``ComposerModel``/
``ComposerResNet`` that Composer has in ``composer.models``), ``composer.algorithms`` -> ``fabric.trainer.algorithms``,
``composer.callbacks`` -> ``fabric.trainer.callbacks``, ``composer.optim.scheduler`` -> ``fabric.trainer.schedulers``,
the ``composer -n 8`` launcher -> ``fabric run -n 2`` (on CPU processes here). What a snippet leaves undefined
(``model``, ``train_dataloader``, the arguments the page cuts off) is filled in with tiny random data, and a logger or
callback where the test needs to read what happened.

Not tested here, because they cannot run on this machine: ``device='gpu'`` (needs a GPU) and the DeepSpeed config with
``"fp16": {"enabled": True}`` (DeepSpeed refuses fp16 on a CPU; its ``{}`` form is tested). The page's pseudocode (the
training loop, ``fit``/``_train_loop``/``_inner_train_batch``) is not Python that runs; what it says about the order of
``forward`` and ``loss`` and the events around them is tested. torchvision has no CPU build installable here, so where a
snippet uses ``torchvision.models`` and torchvision does not import, a small stand-in of the same functions is put in
its place (the real one is used where it imports).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric.trainer import Trainer
from fabric.trainer.core.callback import Callback
from fabric.trainer.core.state import State
from fabric.trainer.loggers import InMemoryLogger

Batch = tuple[torch.Tensor, torch.Tensor]


def _images(samples: int = 8, batch_size: int = 8, classes: int = 10, size: int = 8) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(samples, 3, size, size, generator=generator)
    return DataLoader(TensorDataset(inputs, torch.randint(0, classes, (samples,), generator=generator)), batch_size)


class SmallNet(nn.Module):
    """The snippets' undefined ``model``: a tiny convolutional classifier with Composer's two methods."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.head = nn.Conv2d(3, 8, 3), nn.Linear(8, classes)
        self.net = nn.Sequential(self.conv, nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), self.head)

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.net(batch[0])  # type: ignore[no-any-return]

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(outputs, batch[1])


def _losses(logger: InMemoryLogger) -> list[float]:
    return [float(value) for _, value in logger.data["loss/train/total"]]


def _stand_in_resnet(
    weights: str | None = None, num_classes: int = 1000, groups: int = 1, width_per_group: int = 64
) -> nn.Module:
    assert weights is None and groups == 1 and width_per_group == 64
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, num_classes),
    )


@pytest.fixture
def _torchvision(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import torchvision`` gives the real one where it imports, else a stand-in with ``models.resnet18/50``."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # not installed, or a build that does not load with this torch (a CUDA one here)
        models = types.ModuleType("torchvision.models")
        models.resnet18 = models.resnet50 = _stand_in_resnet  # type: ignore[attr-defined]
        package = types.ModuleType("torchvision")
        package.models = models  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "torchvision", package)
        monkeypatch.setitem(sys.modules, "torchvision.models", models)


# --- Getting Started: a ComposerModel subclass, max_duration=10 (epochs) ----------------------------------------------


@pytest.mark.usefixtures("_torchvision")
def test_getting_started_resnet18_trains_ten_epochs_with_a_progress_bar() -> None:
    # The snippet as written: note that its __init__ does not call super().__init__().
    import torchvision

    from fabric.trainer import ComposerModel

    class ResNet18(ComposerModel):
        def __init__(self):  # type: ignore[no-untyped-def]
            self.model = torchvision.models.resnet18()

        def forward(self, batch):  # type: ignore[no-untyped-def]
            inputs, _ = batch
            return self.model(inputs)

        def loss(self, outputs, batch):  # type: ignore[no-untyped-def]
            _, targets = batch
            return F.cross_entropy(outputs, targets)

    torch.manual_seed(0)
    model = ResNet18()  # type: ignore[no-untyped-call]
    memory = InMemoryLogger()
    trainer = Trainer(
        model=model,
        train_dataloader=_images(size=32),  # one batch per epoch
        max_duration=10,  # epochs
        loggers=memory,
        seed=0,
    )
    trainer.fit()

    assert [name for name, _ in model.named_children()] == ["model"]  # registered without super().__init__()
    assert (int(trainer.state.timestamp.epoch), int(trainer.state.timestamp.batch)) == (10, 10)  # an int is epochs
    losses = _losses(memory)
    assert len(losses) == 10 and losses[-1] < losses[0]
    # "In the background, we automatically add the TQDMLogger" (Composer's later ProgressBarLogger; the same here)
    assert "ProgressBarLogger" in [type(destination).__name__ for destination in trainer.logger.destinations]


# --- Training loop / Events & State: forward, then loss(outputs, batch), with events around each line --------------


class Recorder(Callback):
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def run_event(self, event: Any, state: State, logger: Any) -> None:
        if event in ("before_forward", "after_forward", "before_loss", "after_loss"):
            self.calls.append(str(event))


def test_training_loop_runs_forward_then_loss_with_events_before_and_after_each() -> None:
    calls: list[str] = []
    forwarded: list[torch.Tensor] = []

    class Traced(SmallNet):
        def forward(self, batch: Batch) -> torch.Tensor:
            calls.append("model.forward")
            forwarded.append(outputs := super().forward(batch))
            return outputs

        def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
            calls.append("model.loss")
            assert outputs is forwarded[-1]  # loss gets the forward's outputs
            return super().loss(outputs, batch)

    trainer = Trainer(
        model=Traced(),
        train_dataloader=_images(16, batch_size=8),
        max_duration="2ba",
        callbacks=Recorder(calls),
        progress_bar=False,
    )
    trainer.fit()
    one_batch = ["before_forward", "model.forward", "after_forward", "before_loss", "model.loss", "after_loss"]
    assert calls == one_batch * 2


# --- Algorithms: LayerFreezing and MixUp ---------------------------------------------------------------------------


class Deep(nn.Module):
    """21 parameter layers, so that freeze_level=0.1 freezes two of them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Flatten(), *[nn.Linear(12, 12) for _ in range(20)], nn.Linear(12, 10))
        self.inputs: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []

    def forward(self, batch: Batch) -> torch.Tensor:
        self.inputs.append(batch[0].detach().clone())
        return self.layers(batch[0])  # type: ignore[no-any-return]

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        self.targets.append(batch[1].detach().clone())
        return F.cross_entropy(outputs, batch[1])


def test_algorithms_layer_freezing_and_mixup_apply_during_training() -> None:
    from fabric.trainer.algorithms import LayerFreezing, MixUp

    model = Deep()
    loader = _images(8, batch_size=8, size=2)  # 3 x 2 x 2 = 12 features, one batch per epoch
    trainer = Trainer(
        model=model,
        train_dataloader=loader,
        max_duration="4ep",
        algorithms=[
            LayerFreezing(freeze_start=0.5, freeze_level=0.1),
            MixUp(num_classes=10, alpha=0.1),
        ],
        progress_bar=False,
        seed=0,
    )
    trainer.fit()

    # LayerFreezing: from half of training on, up to 10% of the 21 layers (the two first) stop training
    linears = [module for module in model.layers if isinstance(module, nn.Linear)]
    assert [layer.weight.requires_grad for layer in linears[:3]] == [False, False, True]
    assert all(p.requires_grad for layer in linears[2:] for p in layer.parameters())
    # MixUp: every batch trained on mixed inputs and soft targets over the 10 classes
    clean_inputs, _ = next(iter(loader))
    assert len(model.inputs) == len(model.targets) == 4
    for inputs, targets in zip(model.inputs, model.targets, strict=True):
        assert not torch.equal(inputs, clean_inputs)
        assert targets.shape == (8, 10) and torch.allclose(targets.sum(1), torch.ones(8))  # class probabilities
        assert ((targets > 0) & (targets < 1)).any()  # mixed, not one-hot


class LRUsed(Callback):
    """The learning rate each batch trains with (read before its forward)."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def before_forward(self, state: State, logger: Any) -> None:
        self.lrs.append(float(state.optimizers[0].param_groups[0]["lr"]))


# --- Optimizers & Schedulers: ComposerResNet with PyTorch's SGD and LinearLR ---------------------------------------


@pytest.mark.usefixtures("_torchvision")
def test_optimizers_composer_resnet_with_sgd_and_a_pytorch_linear_lr() -> None:
    from torch.optim import SGD
    from torch.optim.lr_scheduler import LinearLR

    from fabric.trainer import ComposerModel, ComposerResNet, TrainerClassifier

    model = ComposerResNet(model_name="resnet50", num_classes=1000)
    optimizer = SGD(model.parameters(), lr=0.1)
    scheduler = LinearLR(optimizer)

    memory, used = InMemoryLogger(), LRUsed()
    trainer = Trainer(
        model=model,
        optimizers=optimizer,
        schedulers=scheduler,
        train_dataloader=_images(4, batch_size=4, classes=1000, size=32),  # one batch per epoch
        max_duration="3ep",
        callbacks=used,
        loggers=memory,
        progress_bar=False,
    )
    trainer.fit()

    assert isinstance(model, TrainerClassifier) and isinstance(model, ComposerModel) and model.num_classes == 1000
    with torch.no_grad():
        assert model(next(iter(_images(4, batch_size=4, size=32)))).shape == (4, 1000)
    # LinearLR's defaults: factor 1/3 rising to 1 over 5 steps (one batch per epoch: per batch == per epoch)
    assert used.lrs == pytest.approx([0.1 * (1 / 3 + step * (2 / 3) / 5) for step in range(3)])
    assert all(torch.isfinite(torch.tensor(_losses(memory))))


def test_composer_schedulers_step_the_lr_at_30_50_and_90_percent_of_training() -> None:
    from fabric.trainer.optimizers import DecoupledSGDW
    from fabric.trainer.schedulers import MultiStepScheduler

    used = LRUsed()
    trainer = Trainer(
        model=SmallNet(),
        train_dataloader=_images(20, batch_size=4),  # 5 batches per epoch
        max_duration="2ep",
        schedulers=MultiStepScheduler(milestones=["0.3dur", "0.5dur", "0.9dur"], gamma=0.1),
        callbacks=used,
        progress_bar=False,
    )
    trainer.fit()
    assert isinstance(trainer.state.optimizers[0], DecoupledSGDW)  # Composer's default optimizer, lr=0.1
    assert used.lrs == pytest.approx([0.1] * 3 + [0.01] * 2 + [0.001] * 4 + [0.0001])  # from batches 3, 5, 9 of 10


# --- Distributed Training: run_trainer.py under the launcher -------------------------------------------------------

RUN_TRAINER = """
# run_trainer.py
import json, os, sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from fabric.trainer import Trainer


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 3)
        self.seen = []

    def forward(self, batch):
        self.seen += batch[2].tolist()
        return self.linear(batch[0])

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs, batch[1])


model = Model()
dataset = TensorDataset(torch.randn(16, 4), torch.randint(0, 3, (16,)), torch.arange(16))
sampler = DistributedSampler(dataset, num_replicas=int(os.environ["WORLD_SIZE"]), rank=int(os.environ["RANK"]))
train_dataloader = DataLoader(dataset, batch_size=4, sampler=sampler)  # the per-device batch size

trainer = Trainer(model=model, train_dataloader=train_dataloader, max_duration="1ep", progress_bar=False, seed=0)
trainer.fit()

rank = trainer.fabric.global_rank
result = {"world_size": trainer.fabric.world_size, "seen": model.seen, "weight": model.linear.weight.tolist()}
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as file:
    json.dump(result, file)
"""


def test_distributed_run_trainer_under_the_launcher_splits_the_data_and_keeps_ranks_in_sync(tmp_path: Path) -> None:
    script = tmp_path / "run_trainer.py"
    script.write_text(textwrap.dedent(RUN_TRAINER))
    # the page: composer -n 8 run_trainer.py (8 GPUs); here two CPU processes
    command = [sys.executable, "-m", "fabric_cli", "run", "-n", "2", str(script), str(tmp_path)]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [rank["world_size"] for rank in ranks] == [2, 2]
    assert [len(rank["seen"]) for rank in ranks] == [8, 8]  # each rank 2 batches of 4: half of the data
    assert sorted(ranks[0]["seen"] + ranks[1]["seen"]) == list(range(16))
    assert ranks[0]["weight"] == ranks[1]["weight"]  # gradients averaged: the same model on both ranks


# --- DeepSpeed Integration: deepspeed_config={} -------------------------------------------------------------------

DEEPSPEED = """
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric.trainer import Trainer


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, batch):
        return self.linear(batch[0])

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs, batch[1])


torch.manual_seed(0)
model = Model()
before = model.linear.weight.detach().clone()
loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 3, (8,))), batch_size=4)
trainer = Trainer(model=model, train_dataloader=loader, max_duration="2ba", progress_bar=False, deepspeed_config={})
trainer.fit()
strategy = trainer.fabric.strategy
assert type(strategy).__name__ == "DeepSpeedStrategy", type(strategy)
assert strategy.config["train_micro_batch_size_per_gpu"] == 4, strategy.config
assert trainer.fabric.precision.name == "32-true"
assert int(trainer.state.timestamp.batch) == 2
assert not torch.equal(model.linear.weight.detach().cpu(), before)
print("DEEPSPEED-OK")
"""


def test_deepspeed_with_an_empty_config_trains_with_deepspeeds_defaults(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    script = tmp_path / "deepspeed_trainer.py"
    script.write_text(textwrap.dedent(DEEPSPEED))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0 and "DEEPSPEED-OK" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


# --- Callbacks: SpeedMonitor ---------------------------------------------------------------------------------------


def test_speed_monitor_logs_throughput_every_batch() -> None:
    from fabric.trainer.callbacks import SpeedMonitor

    memory = InMemoryLogger()
    # include a callback for tracking throughput/step during training
    trainer = Trainer(
        model=SmallNet(),
        train_dataloader=_images(16, batch_size=4),
        max_duration="4ba",
        callbacks=SpeedMonitor(window_size=100),
        loggers=memory,
        progress_bar=False,
    )
    trainer.fit()
    batches = memory.data["throughput/batches_per_sec"]
    samples = memory.data["throughput/samples_per_sec"]
    assert [step for step, _ in batches] == [1, 2, 3, 4]
    assert all(rate > 0 for _, rate in batches)
    assert [rate for _, rate in samples] == pytest.approx([4 * rate for _, rate in batches])  # 4 samples per batch


# --- Mixed precision: precision='amp' -------------------------------------------------------------------------------


class ForwardDtype(SmallNet):
    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[torch.dtype] = []

    def forward(self, batch: Batch) -> torch.Tensor:
        outputs = super().forward(batch)
        self.dtypes.append(outputs.dtype)  # inside the forward: before Fabric converts the outputs back to fp32
        return outputs


def test_amp_trains_in_float16_autocast_with_loss_scaling() -> None:
    model = ForwardDtype()
    before = model.conv.weight.detach().clone()
    # use mixed precision during training
    trainer = Trainer(
        model=model,
        train_dataloader=_images(16, batch_size=8),
        max_duration="2ba",
        precision="amp",
        progress_bar=False,
    )
    trainer.fit()
    assert trainer.fabric.precision.name == "16-mixed"
    assert getattr(trainer.fabric.strategy.precision, "scaler", None) is not None  # loss scaling, as torch.cuda.amp
    assert model.dtypes == [torch.float16, torch.float16]  # the forward ran in float16
    assert all(parameter.dtype is torch.float32 for parameter in model.parameters())  # fp32 master weights
    assert not torch.equal(model.conv.weight, before)  # and they trained


# --- Checkpointing: save_folder/save_interval, then load_path_format ----------------------------------------------


def test_checkpoints_saved_every_epoch_and_loaded_back_to_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    model = SmallNet()

    ### Saving checkpoints
    trainer = Trainer(
        model=model,
        train_dataloader=_images(16, batch_size=8),
        max_duration="2ep",
        progress_bar=False,
        # Checkpointing params
        save_folder="checkpoints",
        save_interval="1ep",
    )
    trainer.fit()
    # will save checkpoints to the 'checkpoints' folder every epoch
    assert sorted(os.listdir("checkpoints")) == ["ep1-ba2-rank0.pt", "ep2-ba4-rank0.pt", "latest-rank0.pt"]

    Path("path/to/checkpoint").mkdir(parents=True)
    shutil.copy("checkpoints/ep2-ba4-rank0.pt", "path/to/checkpoint/mosaic_states.pt")
    resumed_model = SmallNet()
    assert not torch.equal(resumed_model.head.weight, model.head.weight)

    ### Loading checkpoints
    trainer = Trainer(
        model=resumed_model,
        train_dataloader=_images(16, batch_size=8),
        max_duration="3ep",
        progress_bar=False,
        # Checkpointing params
        load_path_format="path/to/checkpoint/mosaic_states.pt",
    )
    # will load the trainer state (including model weights) from the load_path_format before resuming training
    assert (int(trainer.state.timestamp.epoch), int(trainer.state.timestamp.batch)) == (2, 4)
    assert torch.equal(resumed_model.head.weight, model.head.weight)
    trainer.fit()
    assert (int(trainer.state.timestamp.epoch), int(trainer.state.timestamp.batch)) == (3, 6)  # one more epoch


# --- The Composer names added for these snippets --------------------------------------------------------------------


@pytest.mark.usefixtures("_torchvision")
def test_composer_resnet_checks_its_arguments_and_applies_composers_initializers() -> None:
    from fabric.trainer import ComposerResNet

    visited: list[str] = []
    model = ComposerResNet(
        "resnet50", num_classes=10, initializers=["bn_ones", lambda m: visited.append(type(m).__name__)]
    )
    norms = [module for module in model.modules() if isinstance(module, nn.BatchNorm2d)]
    assert norms and all(torch.equal(norm.weight, torch.ones_like(norm.weight)) for norm in norms)
    assert "BatchNorm2d" in visited and "Linear" in visited  # a function is applied to every submodule
    assert model.num_classes == 10
    with pytest.raises(ValueError, match=r"model_name='vgg16' is not valid\. Accepted: resnet18, resnet34"):
        ComposerResNet("vgg16")
    with pytest.raises(ValueError, match=r"initializer 'orthogonal' is not valid\. Accepted: kaiming_normal"):
        ComposerResNet("resnet18", initializers=["orthogonal"])


def test_composer_resnet_without_torchvision_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from fabric.trainer import ComposerResNet

    monkeypatch.setitem(sys.modules, "torchvision.models", None)  # importing it raises ImportError
    with pytest.raises(ImportError, match="ComposerResNet needs torchvision: pip install torchvision"):
        ComposerResNet("resnet18")


def test_a_composer_model_without_super_init_copies_like_any_module() -> None:
    import copy

    from fabric.trainer import ComposerClassifier, ComposerModel

    class NoSuperInit(ComposerModel):
        def __init__(self, width: int) -> None:
            self.linear = nn.Linear(2, width)
            self.width = width

    model = NoSuperInit(3)
    twin = copy.deepcopy(model)  # as EMA and SWA copy the model
    assert twin.width == 3 and list(twin.state_dict()) == ["linear.weight", "linear.bias"]
    assert torch.equal(twin.linear.weight, model.linear.weight) and twin.linear.weight is not model.linear.weight
    classifier = ComposerClassifier(nn.Linear(2, 3))  # Composer's name, Composer's arguments
    assert isinstance(classifier, ComposerModel) and list(classifier.state_dict()) == ["module.weight", "module.bias"]
