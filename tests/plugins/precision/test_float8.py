"""``precision="fp8-mixed"`` (torchao's float8 training) on CPU, where ``torch._scaled_mm`` runs in torch 2.13: the
layers asked for are converted, training follows bf16-mixed within a stated tolerance (and measurably is not bf16),
checkpoints are precision-free, FSDP2 on two real processes (with and without float8 all-gather) trains like one
process, and what cannot work is refused in one line naming the value."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from float8_model import BODY_LAYERS, TinyLM
from torch import nn
from torchao.float8.float8_linear import Float8Linear

from fabric import Fabric
from fabric.plugins.precision import float8 as float8_module
from fabric.plugins.precision.float8 import Float8Precision
from fabric.plugins.precision.registry import parse_precision

SCRIPT = Path(__file__).parents[2] / "scripts" / "float8_job.py"
VOCAB = 64  # TinyLM's default


def _converted(model: nn.Module) -> list[str]:
    return [name for name, layer in model.named_modules() if isinstance(layer, Float8Linear)]


def _train(precision: str, steps: int) -> tuple[torch.Tensor, nn.Module]:
    torch.manual_seed(0)
    module = TinyLM()
    fabric = Fabric(accelerator="cpu", precision=precision)
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=3e-3))
    tokens = torch.randint(0, VOCAB, (32, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return torch.tensor(losses), model


def test_the_spellings_name_fp8_mixed() -> None:
    assert {parse_precision(name) for name in ("fp8-mixed", "fp8", "amp_fp8")} == {"fp8-mixed"}
    fabric = Fabric(accelerator="cpu", precision="amp_fp8")  # Composer's name
    assert isinstance(fabric.strategy.precision, Float8Precision)


def test_by_default_every_body_linear_is_converted_and_the_head_is_not() -> None:
    model = Fabric(accelerator="cpu", precision="fp8-mixed").setup(TinyLM())
    assert _converted(model.module) == BODY_LAYERS
    assert type(model.module.head) is nn.Linear
    assert model(torch.randint(0, VOCAB, (2, 8))).dtype is torch.float32


def test_convert_head_and_module_filter_choose_the_layers() -> None:
    with_head = Fabric(accelerator="cpu", plugins=Float8Precision(convert_head=True)).setup(TinyLM())
    assert _converted(with_head.module) == [*BODY_LAYERS, "head"]
    first_block = Float8Precision(module_filter=lambda _, name: name.startswith("blocks.0."))
    assert _converted(Fabric(accelerator="cpu", plugins=first_block).setup(TinyLM()).module) == BODY_LAYERS[:2]


def test_a_layer_whose_shape_the_kernels_refuse_is_left_in_bf16() -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 24), nn.ReLU(), nn.Linear(24, 8))
    converted = Fabric(accelerator="cpu", precision="fp8-mixed").setup(model).module
    assert _converted(converted) == ["0"]  # 64 -> 24 has a dimension that is no multiple of 16; "4" is the head


def test_fp8_training_follows_bf16_mixed_and_is_measurably_float8() -> None:
    steps = 40
    bf16, _ = _train("bf16-mixed", steps)
    fp8, model = _train("fp8-mixed", steps)
    fp32, _ = _train("32-true", steps)
    assert _converted(model.module) == BODY_LAYERS
    assert fp8[-1] < 0.75 * fp8[0]  # it learns
    fp8_gap = ((fp8 - bf16).abs() / bf16).max().item()
    bf16_gap = ((bf16 - fp32).abs() / fp32).max().item()
    assert fp8_gap < 0.01, f"fp8-mixed left bf16-mixed by {fp8_gap:.2%} of the loss within {steps} steps"
    # float8 really ran: its rounding moves the loss far more than bf16's own does (measured: 0.25% against 0.01%)
    assert fp8_gap > 5 * bf16_gap, (fp8_gap, bf16_gap)


def test_checkpoints_are_precision_free_an_fp8_run_resumes_in_bf16_and_back(tmp_path: Path) -> None:
    _, fp8_model = _train("fp8-mixed", 3)
    state = fp8_model.module.state_dict()
    assert all(value.dtype is torch.float32 for value in state.values())
    assert sorted(state) == sorted(TinyLM().state_dict())
    fabric = Fabric(accelerator="cpu", precision="fp8-mixed")
    fabric.save(tmp_path / "fp8.ckpt", {"model": fp8_model})
    bf16_fabric = Fabric(accelerator="cpu", precision="bf16-mixed")
    bf16_model = bf16_fabric.setup(TinyLM())
    bf16_fabric.load(tmp_path / "fp8.ckpt", {"model": bf16_model})
    for name, value in bf16_model.state_dict().items():
        assert torch.equal(value, state[name]), name
    bf16_fabric.save(tmp_path / "bf16.ckpt", {"model": bf16_model})
    back = fabric.setup(TinyLM())
    fabric.load(tmp_path / "bf16.ckpt", {"model": back})
    assert _converted(back.module) == BODY_LAYERS
    for name, value in back.state_dict().items():
        assert torch.equal(value, state[name]), name


@pytest.mark.parametrize("all_gather", [False, True], ids=["bf16-all-gather", "float8-all-gather"])
def test_an_optimizer_built_before_setup_trains_the_converted_layers(all_gather: bool) -> None:
    """torchao's float8 all-gather wraps each weight in a new Parameter: Fabric points the optimizer at it (an
    optimizer left on the old objects stepped tensors the model no longer used, and nothing trained)."""
    torch.manual_seed(0)
    module = TinyLM()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    fabric = Fabric(accelerator="cpu", plugins=Float8Precision(fsdp_float8_all_gather=all_gather))
    model, optimizer = fabric.setup(module, optimizer)
    before = {name: value.detach().clone() for name, value in model.module.named_parameters()}
    held = {id(parameter) for group in optimizer.param_groups for parameter in group["params"]}
    assert held == {id(parameter) for parameter in model.module.parameters()}
    loss = F.cross_entropy(model(torch.randint(0, VOCAB, (4, 8))).reshape(-1, VOCAB), torch.randint(0, VOCAB, (32,)))
    fabric.backward(loss)
    optimizer.step()
    for name in (f"{layer}.weight" for layer in BODY_LAYERS):
        assert not torch.equal(model.module.get_parameter(name).detach(), before[name]), name


def _run_job(out: Path, mode: str, argument: str | None = None) -> dict[str, Any]:
    """Run one job of tests/scripts/float8_job.py in the folder ``out`` and return its report."""
    out.mkdir()
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SCRIPT.parents[1]), env.get("PYTHONPATH")]))  # float8_model
    command = [sys.executable, str(SCRIPT), str(out), mode, *([argument] if argument else [])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out / "report.pt")


def _assert_follows(run: dict[str, Any], reference: dict[str, Any]) -> None:
    """Losses and final weights within 2e-3 of the one-process run (measured 6e-4 to 8e-4; the weights move 0.044)."""
    assert run["layer_types"] == ["Float8Linear", "Linear"]
    losses, expected = torch.tensor(run["losses"]), torch.tensor(reference["losses"])
    assert (losses - expected).abs().max() < 2e-3, (losses, expected)
    for name, value in reference["weights"].items():
        assert (run["weights"][name] - value).abs().max() < 2e-3, name


@pytest.fixture(scope="module")
def halves_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process accumulating each batch's two halves: what two data-parallel ranks compute."""
    return _run_job(tmp_path_factory.mktemp("float8") / "reference", "reference")


@pytest.mark.end_to_end  # real ranks (gloo): scripts/test.sh --end-to-end
@pytest.mark.parametrize("all_gather", ["0", "1"], ids=["bf16-all-gather", "float8-all-gather"])
def test_fsdp2_on_two_processes_trains_like_one_process_and_its_checkpoint_reloads(
    halves_reference: dict[str, Any], all_gather: str, tmp_path: Path
) -> None:
    """Two gloo ranks, each on half the batch (float8's activation scales are per forward, hence the halves)."""
    run = _run_job(tmp_path / "fsdp", "fsdp", all_gather)
    _assert_follows(run, halves_reference)
    for name, value in run["weights"].items():
        assert torch.equal(run["reloaded"][name], value), name


@pytest.mark.end_to_end  # real ranks (gloo): scripts/test.sh --end-to-end
def test_tensor_parallel_layers_train_in_float8_like_one_process(tmp_path: Path) -> None:
    """Two gloo ranks split each block's Linear pair with torch's plain ColwiseParallel/RowwiseParallel (a user's
    ``parallelize_fn``) and see the whole batch; the reference is one process on the whole batch."""
    _assert_follows(_run_job(tmp_path / "tp", "tp"), _run_job(tmp_path / "reference", "reference", "1"))


def test_refusals_name_the_value() -> None:
    with pytest.raises(ValueError, match=r"recipe='delayed'\) is not a recipe; accepted: \['tensorwise', 'rowwise'"):
        Float8Precision("delayed")
    with pytest.raises(ValueError, match=r"fsdp_float8_all_gather=True.*'tensorwise' only, not 'rowwise'"):
        Float8Precision("rowwise", fsdp_float8_all_gather=True)
    with pytest.raises(ValueError, match="convert_head=True would be ignored"):
        Float8Precision(module_filter=lambda _, name: True, convert_head=True)
    nothing = Fabric(accelerator="cpu", plugins=Float8Precision(module_filter=lambda _, name: name == "lm_head"))
    with pytest.raises(ValueError, match=r"none of TinyLM's was chosen \(module_filter='<lambda>' chose none\)"):
        nothing.setup(TinyLM())
    only_head = Fabric(accelerator="cpu", precision="fp8-mixed")
    with pytest.raises(ValueError, match=r"none of Sequential's was chosen .*except the last one"):
        only_head.setup(nn.Sequential(nn.Linear(32, 32)))
    odd = Fabric(accelerator="cpu", plugins=Float8Precision(module_filter=lambda _, name: name == "1"))
    with pytest.raises(ValueError, match=r"layer '1' \(32 -> 24\) was chosen.*multiples of 16"):
        odd.setup(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 24), nn.Linear(24, 8)))


def test_deepspeed_refuses_fp8_at_construction() -> None:
    with pytest.raises(ValueError, match=r"precision='fp8-mixed' is not supported with DeepSpeed .*Accepted values"):
        Fabric(accelerator="cpu", strategy="deepspeed", precision="fp8-mixed")


def test_a_device_without_float8_kernels_is_refused_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = Float8Precision()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    message = plugin.device_error("cuda")
    assert message is not None and "capability 8.9 or newer" in message and "A100-SXM4-80GB has 8.0" in message
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert plugin.device_error("cuda") is None
    assert "not on 'mps'" in str(plugin.device_error("mps"))
    monkeypatch.setattr(float8_module, "cpu_runs_float8", lambda: False)
    with pytest.raises(ValueError, match=r"fp8-mixed' needs torch\._scaled_mm on the CPU"):
        Fabric(accelerator="cpu", precision="fp8-mixed")


def test_a_missing_torchao_is_named_with_its_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    float8_module._torchao_float8.cache_clear()
    try:
        with pytest.raises(ModuleNotFoundError, match=r"needs torchao's float8 training: pip install torchao"):
            Fabric(accelerator="cpu", precision="fp8-mixed")
    finally:
        float8_module._torchao_float8.cache_clear()


def test_composers_trainer_trains_in_amp_fp8() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from fabric.trainer import ComposerClassifier, Trainer

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    inputs = torch.randn(256, 32)
    data = TensorDataset(inputs, (inputs[:, :4].argmax(dim=1)))
    model = ComposerClassifier(net, num_classes=4)
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(data, batch_size=32),
        optimizers=torch.optim.Adam(model.parameters(), lr=1e-2),
        max_duration="4ep",
        precision="amp_fp8",
        progress_bar=False,
    )
    before = F.cross_entropy(net(inputs).float(), data.tensors[1]).item()
    trainer.fit()
    assert _converted(net) == ["0", "2"]  # the last Linear is the head
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        after = F.cross_entropy(net(inputs).float(), data.tensors[1]).item()
    assert after < 0.5 * before, (before, after)
