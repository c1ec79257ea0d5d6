"""DeepSpeed ZeRO on 2 real CPU ranks (gloo), its checkpoints, and the config Fabric hands to it."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from scripts.marker_payload import MarkerPayload

from fabric import Fabric
from fabric.plugins.environments import find_free_port
from fabric.plugins.io import deepspeed_checkpoint as checkpoints
from fabric.plugins.io.deepspeed_safe_load import forced_safe_loading
from fabric.strategies.deepspeed import DeepSpeedStrategy, convert_zero_checkpoint_to_fp32
from fabric.strategies.deepspeed.config import complete_config, with_micro_batch_size
from fabric.utilities.exceptions import CheckpointError

SCRIPTS = Path(__file__).parents[2] / "scripts"
STRATEGIES = [f"deepspeed_stage_{name}" for name in ("1", "2", "3", "2_offload", "3_offload")]
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason='deepspeed is not installed (pip install -e ".[deepspeed]")',
)


def _fabric(**kwargs: Any) -> Fabric:
    """A 2-process Fabric on CPU: built and validated, but no process group joined (nothing launched)."""
    return Fabric(accelerator="cpu", devices=2, **kwargs)


# --- the 2-rank job ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Every strategy trained, saved and reloaded in one torchrun job (the first run compiles a C++ op)."""
    out_dir = tmp_path_factory.mktemp("deepspeed")
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={find_free_port()}"]
    result = subprocess.run(
        [*command, str(SCRIPTS / "deepspeed_train.py"), str(out_dir)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return out_dir, [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)]


@needs_deepspeed
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_stage_trains_like_one_process_on_the_full_batch(
    job: tuple[Path, list[dict[str, Any]]], strategy: str
) -> None:
    ranks = [result[strategy] for result in job[1]]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["params"] == ranks[1]["params"], "ranks disagree on the trained weights"
    for trained, expected in zip(ranks[0]["params"], job[1][0]["reference"], strict=True):
        torch.testing.assert_close(torch.tensor(trained), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]
    assert ranks[0]["micro_batch_size"] == 8, "the dataloader's batch size fills the config"


@needs_deepspeed
def test_stage_3_keeps_about_half_of_the_parameters_on_each_rank(job: tuple[Path, list[dict[str, Any]]]) -> None:
    for result in job[1]:
        assert 0.45 < result["deepspeed_stage_3"]["partition_fraction"] < 0.55
        assert 0.45 < result["deepspeed_stage_3_offload"]["partition_fraction"] < 0.55
        assert result["deepspeed_stage_2"]["partition_fraction"] is None


@needs_deepspeed
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_state_dict_of_the_set_up_model_holds_the_full_trained_tensors(
    job: tuple[Path, list[dict[str, Any]]], strategy: str
) -> None:
    total = sum(len(values) for values in job[1][0][strategy]["params"])
    for result in job[1]:
        got = result[strategy]
        assert got["state_dict"] == got["params"]  # gathered on every rank, in parameter order
        if "stage_3" in strategy:  # the partitioned module's own state dict is (nearly) empty: the test means it
            assert got["own_state_numel"] < total / 2
            assert "keep_vars=True) is not available under ZeRO-3" in got["keep_vars_error"]
            assert "fabric.save()" in got["keep_vars_error"]
        else:
            assert got["own_state_numel"] == total and got["keep_vars_error"] == ""


@needs_deepspeed
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sharded_checkpoint_reloads_weights_optimizer_state_and_client_state_exactly(
    job: tuple[Path, list[dict[str, Any]]], strategy: str
) -> None:
    for result in job[1]:
        got = result[strategy]
        assert got["loaded_params_equal"] and got["loaded_optimizer_equal"]
        assert got["loaded_step"] == 5 and got["remainder"] == []
    directory = job[0] / strategy
    tags = [entry.name for entry in directory.iterdir() if entry.name.startswith(checkpoints.TAG_PREFIX)]
    assert tags == [checkpoints.latest_tag(directory)]
    assert checkpoints.saved_world_size(directory, tags[0]) == 2


@needs_deepspeed
@pytest.mark.parametrize("strategy", ["deepspeed_stage_2", "deepspeed_stage_3"])
@pytest.mark.parametrize("how", ["function", "cli", "huggingface"])
def test_consolidated_checkpoint_loads_on_one_device(
    job: tuple[Path, list[dict[str, Any]]], tmp_path: Path, strategy: str, how: str
) -> None:
    """`fabric consolidate` reads every sharded format: DeepSpeed directories as well as DCP ones; with
    `--format huggingface` it writes the float32 weights as a Hugging Face folder (DeepSpeed cannot save one)."""
    output = tmp_path / "consolidated.pt"
    if how == "function":
        convert_zero_checkpoint_to_fp32(job[0] / strategy, output)
    else:
        command = [sys.executable, "-m", "fabric_cli", "consolidate", str(job[0] / strategy), str(output)]
        command += ["--format", "huggingface"] if how == "huggingface" else []
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    state: dict[str, Any] = {"model": model} if how == "huggingface" else {"model": model, "step": 0}
    Fabric(accelerator="cpu", devices=1).load(output, state)
    assert state.get("step", 5) == 5
    trained = job[1][0][strategy]["params"]
    assert [p.detach().flatten().tolist() for p in model.parameters()] == trained


@needs_deepspeed
@pytest.mark.parametrize("strategy", ["deepspeed_stage_2", "deepspeed_stage_3"])
def test_a_deepspeed_checkpoint_directory_loads_on_one_process_with_a_plain_fabric(
    job: tuple[Path, list[dict[str, Any]]], strategy: str
) -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters())
    with pytest.raises(CheckpointError, match=r"has no entry for \['optimizer'\].*strict=False"):
        fabric.load(job[0] / strategy, {"model": model, "optimizer": optimizer, "step": 0})
    assert optimizer.state_dict()["state"] == {}  # refused before anything changed
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(job[0] / strategy, state, strict=False)  # what can be rebuilt: the weights, the client state
    assert state["step"] == 5
    assert [p.detach().flatten().tolist() for p in model.parameters()] == job[1][0][strategy]["params"]


@needs_deepspeed
def test_loading_with_another_world_size_fails_naming_the_ways_out(job: tuple[Path, list[dict[str, Any]]]) -> None:
    directory = job[0] / "deepspeed_stage_2"
    with pytest.raises(CheckpointError, match="saved by 2 ranks and this job has 1") as error:
        checkpoints.check_world_size(directory, checkpoints.latest_tag(directory), world_size=1)
    assert "convert_zero_checkpoint_to_fp32" in str(error.value) and "universal" in str(error.value)


@needs_deepspeed
def test_an_interrupted_save_leaves_the_previous_checkpoint_in_place(
    job: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    directory = tmp_path / "checkpoint"
    shutil.copytree(job[0] / "deepspeed_stage_2", directory)
    good = checkpoints.latest_tag(directory)
    # A save killed midway: its tag directory holds only some shards and `latest` was never moved.
    partial = directory / checkpoints.new_tag()
    partial.mkdir()
    shutil.copy(next((directory / good).glob("*optim_states.pt")), partial)
    assert checkpoints.latest_tag(directory) == good
    convert_zero_checkpoint_to_fp32(directory, tmp_path / "from_good.pt")
    assert torch.load(tmp_path / "from_good.pt", weights_only=True)["step"] == 5
    # The next complete save moves `latest` and clears what the interrupted one left behind.
    shutil.copytree(directory / good, directory / "fabric-next")
    checkpoints.commit(directory, "fabric-next", world_size=2)
    assert checkpoints.latest_tag(directory) == "fabric-next"
    assert sorted(entry.name for entry in directory.iterdir() if entry.is_dir()) == ["fabric-next"]


@needs_deepspeed
@pytest.mark.parametrize("part", ["client_state", "optimizer"])
def test_a_payload_in_a_deepspeed_checkpoint_is_refused_before_anything_is_loaded(
    job: tuple[Path, list[dict[str, Any]]], part: str
) -> None:
    for result in job[1]:  # each rank loaded the poisoned copy into a freshly set-up engine
        got = result["deepspeed_stage_2"]["poisoned"][part]
        shard = "model_states.pt" if part == "client_state" else "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        assert shard in got["error"] and "safe loading (weights_only=True) refuses" in got["error"]
        assert "weights_only=False" in got["error"]
        assert not got["ran"], "the payload ran"
        assert got["unchanged"], "the model changed although the load was refused"


def _poisoned_copy(source: Path, destination: Path, marker: Path) -> Path:
    """``source`` with the payload in its client state; returns the poisoned file."""
    shutil.copytree(source, destination)
    file = next(destination.glob("*/*model_states.pt"))
    saved = torch.load(file, weights_only=False)  # our own checkpoint
    saved["fabric_client_state"]["step"] = MarkerPayload(marker)
    torch.save(saved, file)
    return file


@needs_deepspeed
def test_consolidating_a_poisoned_checkpoint_refuses_it_unless_trusted(
    job: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    marker, output = tmp_path / "marker", tmp_path / "out.pt"
    file = _poisoned_copy(job[0] / "deepspeed_stage_3", tmp_path / "poisoned", marker)
    with pytest.raises(CheckpointError, match=r"safe loading .* refuses") as error:
        convert_zero_checkpoint_to_fp32(tmp_path / "poisoned", output)
    assert file.name in str(error.value) and "weights_only=False" in str(error.value)
    assert not marker.exists() and not output.exists()
    convert_zero_checkpoint_to_fp32(tmp_path / "poisoned", output, weights_only=False)
    assert marker.exists()  # the payload is real: it runs once the user says the checkpoint is trusted


def test_every_torch_load_in_a_safe_deepspeed_load_is_weights_only(tmp_path: Path) -> None:
    """DeepSpeed calls ``torch.load(weights_only=False)``; inside the block that call is made safe."""
    marker, file = tmp_path / "marker", tmp_path / "poisoned.pt"
    torch.save({"weights": torch.ones(2), "extra": MarkerPayload(marker)}, file)
    torch.save({"weights": torch.ones(2)}, tmp_path / "plain.pt")
    with forced_safe_loading():
        assert torch.equal(torch.load(tmp_path / "plain.pt", weights_only=False)["weights"], torch.ones(2))
    with pytest.raises(CheckpointError, match=r"safe loading .* refuses"), forced_safe_loading():
        torch.load(file, weights_only=False)
    assert not marker.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # the process is as it was
    torch.load(file, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("fault", ["legacy format", "truncated"])
def test_a_model_state_file_that_cannot_be_mapped_or_read_gives_a_checkpoint_error_naming_it(
    fault: str, tmp_path: Path
) -> None:
    """A legacy-format (pre-zip) file gave torch's raw ``RuntimeError: mmap can only be used with files saved with
    ...``; it is read whole. Truncated bytes name the file."""
    tag = tmp_path / "checkpoint" / "tag-1"
    tag.mkdir(parents=True)
    (tag.parent / "latest").write_text("tag-1")
    state_file = tag / "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "fabric_client_state": {"step": 7}}, state_file, _use_new_zipfile_serialization=False)
    if fault == "legacy format":
        assert checkpoints.read_client_state(tag.parent, "tag-1") == {"step": 7}
        return
    state_file.write_bytes(state_file.read_bytes()[:40])
    with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states.pt' is not a readable checkpoint"):
        checkpoints.read_client_state(tag.parent, "tag-1")


def test_loading_a_file_as_a_deepspeed_checkpoint_points_to_single_device_loading(tmp_path: Path) -> None:
    file = tmp_path / "weights.pt"
    file.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"not a DeepSpeed checkpoint directory.*single-device Fabric"):
        checkpoints.latest_tag(file)


@pytest.mark.parametrize("pointer", ["absolute", "../../other/global_step1", "sub/global_step1", "..", ".", "  "])
def test_a_latest_file_naming_anything_but_a_tag_inside_the_directory_is_refused(pointer: str, tmp_path: Path) -> None:
    """``latest`` could otherwise make a load read another checkpoint while reporting the given one loaded."""
    elsewhere = tmp_path / "other" / "global_step1"
    elsewhere.mkdir(parents=True)
    directory = tmp_path / "runs" / "checkpoint"
    (directory / "sub" / "global_step1").mkdir(parents=True)
    content = str(elsewhere) if pointer == "absolute" else pointer
    (directory / checkpoints.LATEST).write_text(content)
    with pytest.raises(CheckpointError) as error:
        checkpoints.latest_tag(directory)
    assert str(error.value) == (
        f"{str(directory)!r}: 'latest' holds {content.strip()!r}, which is not a tag: a tag must be the name of a "
        "directory inside the checkpoint directory (one path component, not '.' or '..', no NUL byte)."
    )
    with pytest.raises(CheckpointError, match="which is not a tag"):
        Fabric(accelerator="cpu").load(directory)


# --- what Fabric puts into the config, and what it refuses ------------------------------------------


def test_fabric_fills_what_the_config_leaves_out() -> None:
    config = complete_config(
        {}, stage=3, offload_optimizer=True, offload_parameters=True, precision="bf16-mixed", world_size=2
    )
    assert config["zero_optimization"] == {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
    }
    assert config["bf16"] == {"enabled": True} and "fp16" not in config
    assert config["gradient_accumulation_steps"] == 1 and config["managed_gradient_accumulation"] is False
    assert config["gradient_clipping"] == 0.0
    assert with_micro_batch_size(config, 16)["train_micro_batch_size_per_gpu"] == 16
    assert with_micro_batch_size(config, None)["train_micro_batch_size_per_gpu"] == 1


def test_what_the_config_sets_is_kept() -> None:
    given = {
        "zero_optimization": {"stage": 1},
        "fp16": {"enabled": True, "loss_scale": 0},
        "gradient_clipping": 0.5,
        "gradient_accumulation_steps": 4,
        "train_micro_batch_size_per_gpu": 2,
    }
    config = complete_config(
        given, stage=None, offload_optimizer=False, offload_parameters=False, precision="16-mixed", world_size=2
    )
    assert config["zero_optimization"]["stage"] == 1
    assert config["fp16"] == {"enabled": True, "loss_scale": 0}
    assert config["gradient_clipping"] == 0.5
    assert config["gradient_accumulation_steps"] == 4 and "managed_gradient_accumulation" not in config
    assert with_micro_batch_size(config, 64)["train_micro_batch_size_per_gpu"] == 2
    assert given["zero_optimization"] == {"stage": 1}, "the user's dict is not modified"


def test_registered_names_choose_the_stage_and_offloading() -> None:
    expected = {
        "deepspeed": (2, set()),
        "deepspeed_stage_1": (1, set()),
        "deepspeed_stage_2": (2, set()),
        "deepspeed_stage_2_offload": (2, {"offload_optimizer"}),
        "deepspeed_stage_3": (3, set()),
        "deepspeed_stage_3_offload": (3, {"offload_optimizer", "offload_param"}),
    }
    for name, (stage, offloaded) in expected.items():
        strategy = _fabric(strategy=name).strategy
        assert isinstance(strategy, DeepSpeedStrategy)
        zero = strategy.config["zero_optimization"]
        assert zero["stage"] == stage, name
        assert {key for key in zero if key.startswith("offload")} == offloaded, name


def test_config_from_a_json_file(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}))
    strategy = _fabric(strategy=DeepSpeedStrategy(config=str(path)), precision="bf16-mixed").strategy
    assert isinstance(strategy, DeepSpeedStrategy)
    assert strategy.zero_stage == 3
    with pytest.raises(FileNotFoundError, match=r"missing\.json"):
        DeepSpeedStrategy(config=tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{stage: 3")
    with pytest.raises(ValueError, match=r"bad\.json.*not valid JSON"):
        DeepSpeedStrategy(config=tmp_path / "bad.json")


@pytest.mark.parametrize(
    ("config", "precision", "message"),
    [
        ({"fp16": {"enabled": True}}, "bf16-mixed", r"enables fp16.*precision is 'bf16-mixed'"),
        ({"bf16": {"enabled": True}}, "32-true", r"enables bf16.*precision is '32-true'.*precision='bf16-mixed'"),
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, None, r"enables both fp16 and bf16; enable one"),
        ({"fp16": {"enabled": False}}, "16-mixed", r"disables fp16.*precision is '16-mixed'"),
        ({}, "64-true", r"precision='64-true' is not supported with DeepSpeed.*'bf16-mixed'"),
        ({}, "bf16-true", r"precision='bf16-true' is not supported"),
    ],
)
def test_a_precision_the_config_contradicts_fails_at_construction(
    config: dict[str, Any], precision: str | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _fabric(strategy=DeepSpeedStrategy(config=config), precision=precision)


def test_a_stage_the_config_contradicts_fails_naming_both() -> None:
    with pytest.raises(ValueError, match=r"zero_optimization.stage=3.*asks for stage 2"):
        _fabric(strategy=DeepSpeedStrategy(config={"zero_optimization": {"stage": 3}}, stage=2))
    with pytest.raises(ValueError, match=r"stage=5 is not supported. Accepted values: \[0, 1, 2, 3\]"):
        DeepSpeedStrategy(stage=5)
    with pytest.raises(ValueError, match="offload_parameters=True needs ZeRO stage 3, but the stage is 2"):
        _fabric(strategy=DeepSpeedStrategy(stage=2, offload_parameters=True))


def test_batch_sizes_that_do_not_add_up_for_this_world_size_fail_at_construction() -> None:
    config = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8}
    with pytest.raises(ValueError, match=r"train_batch_size=32 .*=8 x gradient_accumulation_steps=1 x .* size 2"):
        _fabric(strategy=DeepSpeedStrategy(config=config))
    assert _fabric(strategy=DeepSpeedStrategy(config={"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8}))


def test_steps_deepspeed_cannot_take_are_refused_with_the_alternative() -> None:
    strategy = _fabric(strategy="deepspeed").strategy
    model = torch.nn.Linear(2, 2)
    first, second = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="exactly one optimizer, got 2"):
        strategy.setup_module_and_optimizers(model, [first, second])
    with pytest.raises(ValueError, match=r"fabric.setup\(model, optimizer\)"):
        strategy.setup_optimizer(first)
    with pytest.raises(RuntimeError, match=r"'gradient_clipping': 1\.5 in the DeepSpeed config"):
        strategy.clip_gradients_norm(model, first, max_norm=1.5)


def test_importing_fabric_and_choosing_deepspeed_does_not_import_it() -> None:
    code = (
        "import sys; from fabric import Fabric; import fabric.strategies.deepspeed.strategy; "
        "Fabric(accelerator='cpu', strategy='deepspeed_stage_3', devices=2); print('deepspeed' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "False"


@needs_deepspeed
def test_a_scheduler_set_up_with_the_engine_is_stepped_by_it_saved_and_loaded(
    job: tuple[Path, list[dict[str, Any]]],
) -> None:
    """Lightning's ``fabric.setup(model, optimizer, scheduler=...)``: DeepSpeed steps it after every step."""
    for result in job[1]:
        got = result["scheduled"]
        assert got["returned_is_scheduler"]
        assert got["learning_rates"] == [0.025, 0.0125, 0.00625]  # halved once per optimizer step, not twice
        for trained, expected in zip(got["params"], got["reference"], strict=True):
            torch.testing.assert_close(torch.tensor(trained), torch.tensor(expected), rtol=1e-5, atol=1e-6)
        assert got["loaded_last_epoch"] == 3 and got["loaded_lr"] == 0.00625
    warned = job[1][0]["scheduled"]["warnings"]
    assert len(warned) == 1 and "DeepSpeed already steps the scheduler" in warned[0], warned
    assert "(1 time(s) since the last one)" in warned[0]


@needs_deepspeed
def test_a_plateau_scheduler_is_refused_and_a_stray_scheduler_named() -> None:
    strategy = DeepSpeedStrategy()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"ReduceLROnPlateau needs: leave it out of setup\(\)"):
        strategy.setup_module_and_optimizers(model, [optimizer], torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer))
    fabric = Fabric(accelerator="cpu")
    other = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"setup\(scheduler=StepLR\(...\)\) needs the optimizer it schedules"):
        fabric.setup(model, optimizer, scheduler=torch.optim.lr_scheduler.StepLR(other, step_size=1))
    with pytest.raises(TypeError, match=r"expects a torch\.optim\.lr_scheduler\.LRScheduler"):
        fabric.setup(model, optimizer, scheduler="cosine")  # type: ignore[call-overload]
