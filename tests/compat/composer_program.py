"""A program written for Composer (its imports only: ``composer``, ``composer.models``, ``composer.algorithms``, ...),
for the drop-in tests: ``python composer_program.py OUT_DIR``. It trains a small classifier on data of its own for
two epochs with an algorithm, a callback, a scheduler and an evaluator, and writes what each rank computed."""

import json
import sys
from pathlib import Path

import torch
from composer import Trainer
from composer.algorithms import LabelSmoothing
from composer.callbacks import LRMonitor
from composer.core import Evaluator, Event
from composer.loggers import InMemoryLogger
from composer.models import ComposerClassifier
from composer.optim import DecoupledSGDW, LinearWithWarmupScheduler
from composer.utils import reproducibility
from torch.utils.data import DataLoader, TensorDataset

out = Path(sys.argv[1])
reproducibility.seed_all(42)
generator = torch.Generator().manual_seed(0)
inputs = torch.randn(128, 8, generator=generator)
labels = (inputs[:, 0] + inputs[:, 1] > 0).long()
train = DataLoader(TensorDataset(inputs[:96], labels[:96]), batch_size=8, shuffle=True, generator=generator)
evaluation = DataLoader(TensorDataset(inputs[96:], labels[96:]), batch_size=8)
model = ComposerClassifier(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)),
                           num_classes=2)  # fmt: skip
logger = InMemoryLogger()
trainer = Trainer(
    model=model,
    train_dataloader=train,
    eval_dataloader=Evaluator(label="eval", dataloader=evaluation, metric_names=["MulticlassAccuracy"]),
    max_duration="2ep",
    optimizers=DecoupledSGDW(model.parameters(), lr=0.5),
    schedulers=LinearWithWarmupScheduler(t_warmup="2ba"),
    algorithms=[LabelSmoothing(smoothing=0.1)],
    callbacks=[LRMonitor()],
    loggers=[logger],
    device="cpu",
    progress_bar=False,
    seed=42,
)
trainer.fit()
accuracy = trainer.state.eval_metrics["eval"]["MulticlassAccuracy"].compute().item()
report = {
    "trainer_class": f"{type(trainer).__module__}.{type(trainer).__name__}",
    "world_size": trainer.fabric.world_size,
    "fit_end_is_an_event": Event.FIT_END.value,
    "losses": logger.get_timeseries("loss/train/total")["loss/train/total"],
    "learning_rates": logger.get_timeseries("lr-DecoupledSGDW/group0")["lr-DecoupledSGDW/group0"],
    "eval_accuracy": accuracy,
}
(out / f"rank{trainer.fabric.global_rank}.json").write_text(json.dumps(report))
