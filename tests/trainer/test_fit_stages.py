"""Issue 28 items 1 and 4: Composer's ``fit()`` arguments train in stages, and a Trainer without optimizers trains
with Composer's default ``DecoupledSGDW(lr=0.1)``. Each stage is checked against a hand-written PyTorch loop."""

from __future__ import annotations

import copy
import itertools
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric.trainer.core.callback import Callback
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time, TimeUnit
from fabric.trainer.optimizers import DecoupledSGDW
from fabric.trainer.schedulers import LinearScheduler
from fabric.trainer.trainer import Trainer

Batch = tuple[torch.Tensor, torch.Tensor]
SCRIPT = Path(__file__).parents[1] / "scripts" / "trainer_two_stage.py"


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.autocast_dtypes: list[torch.dtype | None] = []

    def forward(self, batch: Batch) -> torch.Tensor:
        enabled = torch.is_autocast_enabled("cpu")
        self.autocast_dtypes.append(torch.get_autocast_dtype("cpu") if enabled else None)
        return self.net(batch[0])  # type: ignore[no-any-return]

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        return F.mse_loss(outputs.squeeze(-1), batch[1])


def _data(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 4, generator=generator)
    return TensorDataset(x, x.sum(1).sin())


def _loader(samples: int = 24, seed: int = 0, batch_size: int = 4, shuffle: bool = True) -> DataLoader[Any]:
    """The same loader, with the same shuffles, every time it is built."""
    generator = torch.Generator().manual_seed(seed + 100)
    return DataLoader(_data(samples, seed), batch_size=batch_size, shuffle=shuffle, generator=generator)


def _trainer(model: nn.Module, **options: Any) -> Trainer:
    settings: dict[str, Any] = {"progress_bar": False, "seed": 0, "accelerator": "cpu"}
    settings.update(options)
    return Trainer(model=model, **settings)


def _train_by_hand(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Callable[[], Iterable[Batch]],
    epochs: int,
    autocast: torch.dtype | None = None,
    microbatch: int | None = None,
) -> None:
    """A plain PyTorch loop: ``epochs`` passes over ``batches()``."""
    for _ in range(epochs):
        for x, y in batches():
            parts = [(x, y)] if microbatch is None else list(zip(x.split(microbatch), y.split(microbatch), strict=True))
            for part_x, part_y in parts:
                with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                    outputs = model.net(part_x)
                loss = F.mse_loss(outputs.float().squeeze(-1), part_y) * (len(part_x) / len(x))
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def _assert_same_weights(trained: nn.Module, reference: nn.Module, exact: bool = True) -> None:
    for ours, theirs in zip(trained.parameters(), reference.parameters(), strict=True):
        if exact:
            assert torch.equal(ours, theirs)
        else:
            torch.testing.assert_close(ours, theirs)


# --- the two-stage fit of the issue ---------------------------------------------------------------------------


def test_two_stages_with_a_new_loader_reset_time_and_new_optimizer_match_a_plain_pytorch_loop() -> None:
    model = Regressor()
    reference = copy.deepcopy(model)
    trainer = _trainer(model, train_dataloader=_loader(), optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
    trainer.fit(duration="2ep")
    stamp = trainer.state.timestamp
    assert (int(stamp.epoch), int(stamp.batch), int(stamp.sample)) == (2, 12, 48)
    assert trainer.state.max_duration == Time(2, TimeUnit.EPOCH)
    finetune = torch.optim.Adam(model.parameters(), lr=0.01)
    trainer.fit(train_dataloader=_loader(16, seed=1), duration="1ep", reset_time=True, optimizers=finetune)
    stamp = trainer.state.timestamp
    assert (int(stamp.epoch), int(stamp.batch), int(stamp.sample)) == (1, 4, 16)  # the clock restarted at zero
    assert trainer.state.max_duration == Time(1, TimeUnit.EPOCH)
    assert [type(optimizer.optimizer) for optimizer in trainer.state.optimizers] == [torch.optim.Adam]

    first = _loader()
    _train_by_hand(reference, torch.optim.SGD(reference.parameters(), lr=0.1), lambda: first, epochs=2)
    second = _loader(16, seed=1)
    _train_by_hand(reference, torch.optim.Adam(reference.parameters(), lr=0.01), lambda: second, epochs=1)
    _assert_same_weights(model, reference)


def test_duration_adds_to_the_current_time_in_its_own_unit_as_in_composer() -> None:
    model = Regressor()  # 6 batches per epoch
    trainer = _trainer(model, train_dataloader=_loader(), optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
    trainer.fit(duration="3ba")
    assert trainer.state.max_duration == Time(3, TimeUnit.BATCH)
    trainer.fit(duration="1ep")  # epoch 0 is current: max_duration = 0ep + 1ep, the end of this epoch
    assert trainer.state.max_duration == Time(1, TimeUnit.EPOCH)
    assert (int(trainer.state.timestamp.epoch), int(trainer.state.timestamp.batch)) == (1, 6)
    trainer.fit(duration="2ba")
    assert trainer.state.max_duration == Time(8, TimeUnit.BATCH) and int(trainer.state.timestamp.batch) == 8
    trainer.fit(duration="16sp", reset_time=True)
    assert trainer.state.max_duration == Time(16, TimeUnit.SAMPLE)
    stamp = trainer.state.timestamp
    assert (int(stamp.epoch), int(stamp.batch), int(stamp.batch_in_epoch), int(stamp.sample)) == (0, 4, 4, 16)


def test_scale_schedule_ratio_of_fit_scales_the_whole_max_duration_and_needs_schedulers() -> None:
    model = Regressor()
    trainer = _trainer(model, train_dataloader=_loader(), optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"scale_schedule_ratio=0.5\) scales the schedulers given with it"):
        trainer.fit(duration="4ep", scale_schedule_ratio=0.5)
    assert trainer.state.max_duration is None  # the refused call changed nothing
    lrs: list[float] = []

    class LearningRates(Callback):
        def batch_start(self, state: State, logger: Any) -> None:
            lrs.append(state.optimizers[0].param_groups[0]["lr"])

    trainer = _trainer(
        model,
        train_dataloader=_loader(),
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=[LearningRates()],
    )
    trainer.fit(
        duration="4ep", schedulers=LinearScheduler(alpha_i=1.0, alpha_f=0.0, t_max="4ep"), scale_schedule_ratio=0.5
    )
    assert trainer.state.max_duration == Time(2, TimeUnit.EPOCH) and int(trainer.state.timestamp.batch) == 12
    # t_max 4ep scaled to 2ep = 12 batches: the rate falls linearly to 0 over the whole (scaled) run
    assert lrs == pytest.approx([0.1 * (1 - batch / 12) for batch in range(12)])


# --- optimizers and schedulers ---------------------------------------------------------------------------------


def test_new_optimizers_take_over_the_schedule_functions_and_stale_pytorch_schedulers_are_refused() -> None:
    model = Regressor()
    old = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = _trainer(
        model,
        train_dataloader=_loader(),
        optimizers=old,
        schedulers=LinearScheduler(alpha_i=1.0, alpha_f=0.5, t_max="2ep"),
    )
    trainer.fit(duration="1ep")
    new = torch.optim.SGD(model.parameters(), lr=1.0)
    trainer.fit(duration="1ep", optimizers=new)
    # the schedule (a function of time) now sets the new optimizer's rate, from its own base rate of 1.0
    assert new.param_groups[0]["lr"] == pytest.approx(1.0 * (1 - 0.5 * 11 / 12))
    assert old.param_groups[0]["lr"] == pytest.approx(0.1 * (1 - 0.5 * 5 / 12))  # left where stage 1 ended

    stepped = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = _trainer(
        model,
        train_dataloader=_loader(),
        optimizers=stepped,
        schedulers=torch.optim.lr_scheduler.StepLR(stepped, step_size=1, gamma=0.5),
    )
    with pytest.raises(ValueError, match=r"StepLR schedules an optimizer that fit\(optimizers=\.\.\.\) replaces"):
        trainer.fit(duration="1ba", optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
    replacement = torch.optim.SGD(model.parameters(), lr=0.2)
    steplr = torch.optim.lr_scheduler.StepLR(replacement, step_size=1, gamma=0.5)
    trainer.fit(duration="2ba", optimizers=replacement, schedulers=steplr, step_schedulers_every_batch=True)
    assert replacement.param_groups[0]["lr"] == pytest.approx(0.2 * 0.5**2)
    assert trainer.state.schedulers == [steplr]
    assert trainer.checkpointer.trainer_state.schedulers == [steplr]  # the checkpoints save the new one


def test_optimizers_that_cannot_train_the_model_are_refused_and_change_nothing() -> None:
    model = Regressor()
    original = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = _trainer(model, train_dataloader=_loader(), optimizers=original)
    stranger = nn.Linear(3, 3)
    with pytest.raises(ValueError, match=r"holds 2 parameter\(s\) that are not the model's"):
        trainer.fit(duration="1ep", optimizers=torch.optim.SGD(stranger.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"expected torch\.optim\.Optimizer objects"):
        trainer.fit(duration="1ep", optimizers="adam")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"fit\(optimizers=\[\]\) gives no optimizer"):
        trainer.fit(duration="1ep", optimizers=[])
    assert trainer.state.max_duration is None and trainer.state.optimizers[0].optimizer is original
    trainer.fit(duration="1ba", optimizers=trainer.state.optimizers)  # the Trainer's own, already set up: kept


# --- precision, microbatches, evaluation, subsets -----------------------------------------------------------


def test_precision_switches_to_bf16_autocast_for_the_next_stage_and_matches_a_plain_loop() -> None:
    model = Regressor()
    reference = copy.deepcopy(model)
    trainer = _trainer(model, train_dataloader=_loader(), optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
    trainer.fit(duration="1ep")
    assert set(model.autocast_dtypes) == {None}
    model.autocast_dtypes.clear()
    trainer.fit(duration="1ep", precision="amp_bf16")
    assert trainer.fabric.strategy.precision.name == "bf16-mixed"
    assert set(model.autocast_dtypes) == {torch.bfloat16}
    model.autocast_dtypes.clear()
    trainer.fit(duration="1ba")  # the precision stays, as Composer's state.precision does
    assert set(model.autocast_dtypes) == {torch.bfloat16}

    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    loader = _loader()
    _train_by_hand(reference, optimizer, lambda: loader, epochs=1)
    _train_by_hand(reference, optimizer, lambda: loader, epochs=1, autocast=torch.bfloat16)
    _train_by_hand(reference, optimizer, lambda: itertools.islice(loader, 1), epochs=1, autocast=torch.bfloat16)
    _assert_same_weights(model, reference)
    trainer.fit(duration="2ba", precision="amp")  # float16 autocast with loss scaling, also on the CPU
    assert trainer.fabric.strategy.precision.name == "16-mixed" and trainer._train_step._unscale
    assert model.autocast_dtypes[-1] == torch.float16 and all(p.isfinite().all() for p in model.parameters())


def test_precision_switches_that_would_change_the_parameters_are_refused() -> None:
    model = Regressor()
    trainer = _trainer(model, train_dataloader=_loader(), optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"fit\(precision='bf16-true'\) cannot switch from '32-true'"):
        trainer.fit(duration="1ep", precision="bf16-true")
    with pytest.raises(ValueError, match="Unknown precision 'fp64'"):
        trainer.fit(duration="1ep", precision="fp64")
    lbfgs = _trainer(model, train_dataloader=_loader(), optimizers=torch.optim.LBFGS(model.parameters()))
    with pytest.raises(ValueError, match=r"LBFGS steps with a closure.*GradScaler"):
        lbfgs.fit(duration="1ep", precision="amp")
    assert lbfgs.fabric.strategy.precision.name == "32-true" and lbfgs.state.max_duration is None


def test_microbatch_size_given_to_fit_splits_the_next_stage_with_the_same_gradient() -> None:
    model = Regressor()
    reference = copy.deepcopy(model)
    sizes: list[int] = []

    class Sizes(Callback):
        def before_forward(self, state: State, logger: Any) -> None:
            sizes.append(len(state.batch[0]))

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = _trainer(model, train_dataloader=_loader(), optimizers=optimizer, callbacks=[Sizes()])
    trainer.fit(duration="1ep")
    trainer.fit(duration="1ep", device_train_microbatch_size=2)
    assert sizes == [4] * 6 + [2] * 12 and trainer.state.device_train_microbatch_size == 2
    by_hand = torch.optim.SGD(reference.parameters(), lr=0.1)
    loader = _loader()
    _train_by_hand(reference, by_hand, lambda: loader, epochs=1)
    _train_by_hand(reference, by_hand, lambda: loader, epochs=1, microbatch=2)
    _assert_same_weights(model, reference, exact=False)
    trainer.fit(duration="1ba", device_train_microbatch_size="auto")
    assert trainer._train_step.auto_microbatching


def test_eval_settings_given_to_fit_apply_to_new_and_existing_evaluators() -> None:
    counts: list[tuple[int, str]] = []

    class EvalBatches(Callback):
        def eval_batch_end(self, state: State, logger: Any) -> None:
            counts.append((int(state.timestamp.batch), str(state.dataloader_label)))

    model = Regressor()
    trainer = _trainer(
        model,
        train_dataloader=_loader(),
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=[EvalBatches()],
    )
    with pytest.raises(ValueError, match="there is no eval_dataloader"):
        trainer.fit(duration="1ba", eval_interval="2ba")
    trainer.fit(
        duration="4ba", eval_dataloader={"val": _loader(12, seed=2)}, eval_interval="2ba", eval_subset_num_batches=1
    )
    assert counts == [(2, "val"), (4, "val")]
    counts.clear()
    trainer.fit(duration="2ba", eval_subset_num_batches=2)  # the evaluators of the earlier fit, interval kept
    assert counts == [(6, "val"), (6, "val")]


def test_reset_time_restarts_the_intervals_of_evaluation_and_saving(tmp_path: Path) -> None:
    evaluated: list[int] = []

    class Evaluations(Callback):
        def eval_end(self, state: State, logger: Any) -> None:
            evaluated.append(int(state.timestamp.batch))

    model = Regressor()
    trainer = _trainer(
        model,
        train_dataloader=_loader(),
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        eval_dataloader=_loader(8, seed=2),
        eval_interval="2ba",
        save_folder=str(tmp_path),
        save_interval="2ba",
        save_overwrite=True,
        callbacks=[Evaluations()],
    )
    trainer.fit(duration="2ba")
    trainer.fit(duration="2ba", reset_time=True)  # batch 2 again: both intervals fire again
    assert evaluated == [2, 2]
    assert trainer.saver is not None and [Path(path).name for path in trainer.saver.saved] == ["ep0-ba2-rank0.pt"] * 2


def test_train_subset_num_batches_of_fit_shortens_the_epochs_of_the_next_stage() -> None:
    model = Regressor()
    reference = copy.deepcopy(model)
    trainer = _trainer(model, train_dataloader=_loader(), optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
    trainer.fit(duration="1ep")
    trainer.fit(duration="2ep", train_subset_num_batches=2)
    stamp = trainer.state.timestamp
    assert (int(stamp.epoch), int(stamp.batch), trainer.state.dataloader_len) == (3, 10, 2)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    loader = _loader()
    _train_by_hand(reference, optimizer, lambda: loader, epochs=1)
    _train_by_hand(reference, optimizer, lambda: itertools.islice(loader, 2), epochs=2)
    _assert_same_weights(model, reference)


# --- item 1: Composer's default optimizer ----------------------------------------------------------------------


def test_without_optimizers_the_trainer_trains_with_decoupled_sgdw_lr_0_1_and_says_so() -> None:
    model = Regressor()
    reference = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"No optimizer was specified\. Defaulting to DecoupledSGDW\(lr=0\.1\)"):
        trainer = _trainer(model, train_dataloader=_loader(), max_duration="2ep")
    (optimizer,) = trainer.state.optimizers
    assert type(optimizer.optimizer) is DecoupledSGDW and optimizer.param_groups[0]["lr"] == 0.1
    trainer.fit()
    loader = _loader()
    _train_by_hand(reference, DecoupledSGDW(reference.parameters(), lr=0.1), lambda: loader, epochs=2)
    _assert_same_weights(model, reference)


def test_a_configuration_error_comes_without_the_default_optimizer_warning_before_it(
    recwarn: pytest.WarningsRecorder,
) -> None:
    """Every Trainer configuration error was preceded by "No optimizer was specified. Defaulting to ..."."""
    with pytest.raises(ValueError, match="eval_interval"):
        _trainer(Regressor(), train_dataloader=_loader(), max_duration="2ep", eval_interval="often")
    assert [str(w.message) for w in recwarn if "No optimizer" in str(w.message)] == []


def test_an_eval_only_trainer_needs_no_optimizer_until_it_is_asked_to_train(recwarn: pytest.WarningsRecorder) -> None:
    model = Regressor()
    reference = copy.deepcopy(model)
    trainer = _trainer(model, eval_dataloader=_loader(8, seed=3))
    assert trainer.state.optimizers == [] and not [w for w in recwarn if "No optimizer" in str(w.message)]
    assert set(trainer.eval()) == set()  # the model has no metrics; it ran without an optimizer
    with pytest.warns(UserWarning, match="Defaulting to DecoupledSGDW"):
        trainer.fit(train_dataloader=_loader(), duration="1ep")
    assert type(trainer.state.optimizers[0].optimizer) is DecoupledSGDW
    loader = _loader()
    _train_by_hand(reference, DecoupledSGDW(reference.parameters(), lr=0.1), lambda: loader, epochs=1)
    _assert_same_weights(model, reference)


# --- DDP and FSDP: two real ranks ------------------------------------------------------------------------------


def _two_ranks(strategy: str, out: Path) -> dict[str, Any]:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), strategy, str(out)], capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out, weights_only=True)  # type: ignore[no-any-return]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_stages_on_two_ranks_match_one_process_training_on_the_global_batch(strategy: str, tmp_path: Path) -> None:
    """A new optimizer in stage 2 is set up with the strategy (FSDP points it at the shards); the ranks' shares of
    each global batch of 8 average to the one-process gradient."""
    ran = _two_ranks(strategy, tmp_path / "out.pt")
    assert ran["stamps"] == [(2, 8, 64), (1, 2, 16)]
    expected = {"ddp": "DDPStrategy", "fsdp": "FSDPStrategy"}[strategy]
    assert (ran["strategy"], ran["world_size"], ran["timeout"]) == (expected, 2, 123.0)  # dist_timeout reached it
    reference = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    reference.load_state_dict(ran["initial"])
    holder = nn.Module()
    holder.net = reference
    first = DataLoader(_data(32, seed=0), batch_size=8)
    _train_by_hand(holder, torch.optim.SGD(reference.parameters(), lr=0.1), lambda: first, epochs=2)
    second = DataLoader(_data(16, seed=1), batch_size=8)
    _train_by_hand(holder, torch.optim.Adam(reference.parameters(), lr=0.01), lambda: second, epochs=1)
    for ours, theirs in zip(ran["weights"], reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs.detach())
