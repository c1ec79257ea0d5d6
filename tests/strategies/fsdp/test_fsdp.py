"""FSDP2 on real CPU ranks (gloo): training, sharding, checkpoints, meta init, and ``fabric consolidate``.

Process launches are few: one 2-rank job checks training and everything that needs live shards
(tests/scripts/fsdp_job.py), one 1-rank job reloads its checkpoints; the tests assert on what they wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from fabric import Fabric
from fabric.strategies import STRATEGY_REGISTRY
from fabric.strategies.fsdp.strategy import FSDPStrategy
from fabric.utilities.exceptions import CheckpointError
from fabric_cli.cli import cli

SCRIPTS = Path(__file__).parents[2] / "scripts"
ROOT = Path(__file__).resolve().parents[3]


def _run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-rank training job's output directory (reports, tensors, checkpoints)."""
    out_dir = tmp_path_factory.mktemp("fsdp")
    result = _run([sys.executable, str(SCRIPTS / "fsdp_job.py"), str(out_dir), "train", "2"])
    assert result.returncode == 0, result.stderr[-4000:]
    return out_dir


def _reports(out_dir: Path, mode: str, world_size: int) -> list[dict]:
    return [json.loads((out_dir / f"{mode}-rank{rank}.json").read_text()) for rank in range(world_size)]


def _assert_same_tensors(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        if isinstance(a, list):
            _assert_same_tensors(a, b)
        else:
            assert torch.equal(a, b)


def test_fsdp_trains_like_one_process_on_the_full_batch(job: Path) -> None:
    for report in _reports(job, "train", 2):
        assert report["world_size"] == 2
        # accumulation under no_backward_sync, then clipping by the global norm over both ranks' shards
        assert report["norms"] == pytest.approx(report["reference_norms"], rel=1e-5)
        assert max(report["reference_norms"]) > 0.5  # the clip really clipped
        assert report["max_diff_to_reference"] < 1e-5


def test_each_rank_holds_about_half_of_every_parameter(job: Path) -> None:
    reports = _reports(job, "train", 2)
    total = reports[0]["total_numel"]
    assert sum(r["local_numel"] for r in reports) == total
    for report in reports:
        assert 0.4 * total < report["local_numel"] < 0.6 * total


def test_an_optimizer_built_before_setup_is_re_pointed_and_a_foreign_one_refused(job: Path) -> None:
    report = _reports(job, "train", 2)[0]
    assert report["all_dtensors"]
    assert "belongs to no module set up with FSDPStrategy" in report["foreign_optimizer"]
    assert "build the optimizer from the parameters of the module it returns" in report["foreign_optimizer"]


def test_sharded_save_is_a_directory_that_reloads_exactly_on_two_ranks(job: Path) -> None:
    for report in _reports(job, "train", 2):
        assert report["sharded_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        assert report["reload_step"] == 5
        assert report["reload_params_equal"] and report["reload_optimizer_equal"]
        assert report["reload_kept_the_live_loader"]  # a set-up loader in a sharded save loads with weights_only=True
    assert not [p for p in job.iterdir() if ".tmp-" in p.name or ".old-" in p.name]  # no leftovers


def test_a_failed_load_raises_and_changes_nothing(job: Path) -> None:
    for report in _reports(job, "train", 2):
        assert report["failed_load"] == "CheckpointError"
        assert report["failed_load_unchanged"] and report["failed_load_optimizer_empty"]


def test_meta_device_init_gives_finite_reset_weights_and_guards_uninitialised_ones(job: Path) -> None:
    for report in _reports(job, "train", 2):
        assert report["meta_before_setup"] and report["meta_finite"] and report["meta_within_init_bounds"]
        assert report["meta_equals_seeded_init"] and report["meta_setup_warnings"] == []
        assert "(scale)" in report["uninitialised_forward"] and "fabric.load()" in report["uninitialised_forward"]
        assert report["after_load_forward_equal"]
        assert report["param_init_fn_used"]  # Composer's convention; before, reset_parameters() drew other weights


def test_hybrid_shard_on_one_node_uses_a_replicate_by_shard_mesh(job: Path) -> None:
    for report in _reports(job, "train", 2):
        assert report["hybrid_mesh"] == [[1, 2], ["data_parallel_replicate", "data_parallel"]]
        assert report["hybrid_placements"] == ["R", "S(0)"]
        assert report["hybrid_grad_matches"]


def test_two_rank_checkpoints_reload_exactly_on_one_rank(job: Path) -> None:
    result = _run([sys.executable, str(SCRIPTS / "fsdp_job.py"), str(job), "reload", "1"])
    assert result.returncode == 0, result.stderr[-4000:]
    assert _reports(job, "reload", 1)[0] == {"world_size": 1, "step": 5, "full_step": 5}
    trained, reloaded = torch.load(job / "train.pt"), torch.load(job / "reload.pt")
    _assert_same_tensors(reloaded["params"], trained["params"])  # from the sharded directory
    _assert_same_tensors(reloaded["optimizer"], trained["optimizer"])
    _assert_same_tensors(reloaded["full_params"], trained["params"])  # from the full file
    _assert_same_tensors(reloaded["full_optimizer"], trained["optimizer"])


def _single_device_state() -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    return model, optimizer, {"model": model, "optimizer": optimizer, "step": 0}


def _adam_tensors(optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [[optimizer.state[p][name] for name in ("step", "exp_avg", "exp_avg_sq")] for p in params]


def test_consolidate_writes_one_file_that_plain_torch_and_a_single_device_load(job: Path, tmp_path: Path) -> None:
    output = tmp_path / "consolidated.pt"
    result = _run([sys.executable, "-m", "fabric_cli", "consolidate", str(job / "sharded"), str(output)])
    assert result.returncode == 0, result.stderr
    assert f"wrote {output}" in result.stdout
    trained = torch.load(job / "train.pt")
    raw = torch.load(output, weights_only=True)
    assert raw["step"] == 5 and sorted(raw["optimizer"]["state"]) == [0, 1, 2, 3, 4, 5]
    _assert_same_tensors(list(raw["model"].values()), trained["params"])

    fabric = Fabric(accelerator="cpu", devices=1)
    for source in (output, job / "sharded"):  # the consolidated file, or the directory read whole
        model, optimizer, state = _single_device_state()
        model, optimizer = fabric.setup(model, optimizer)
        fabric.load(source, state)
        assert state["step"] == 5
        _assert_same_tensors([p.detach() for p in model.parameters()], trained["params"])
        _assert_same_tensors(_adam_tensors(optimizer), trained["optimizer"])


def test_consolidate_to_huggingface_writes_the_sharded_models_weights_as_safetensors(job: Path, tmp_path: Path) -> None:
    output = tmp_path / "hf"
    arguments = ["consolidate", str(job / "sharded"), str(output), "--format", "huggingface", "--max-file-bytes", "600"]
    result = CliRunner().invoke(cli, arguments)
    assert result.exit_code == 0, result.output
    assert result.output == f"wrote {output} (6 tensors)\n"
    files = sorted(path.name for path in output.iterdir())
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + ["model.safetensors.index.json"]
    model, *_ = _single_device_state()
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.load(output, {"model": fabric.setup(model)})
    _assert_same_tensors([p.detach() for p in model.parameters()], torch.load(job / "train.pt")["params"])

    refused = CliRunner().invoke(cli, ["consolidate", str(job / "sharded"), "--max-file-bytes", "600"])
    assert refused.exit_code == 2 and "--max-file-bytes sizes the files of --format huggingface only" in refused.output


def test_consolidate_refuses_a_path_that_is_not_a_sharded_checkpoint(tmp_path: Path) -> None:
    result = _run([sys.executable, "-m", "fabric_cli", "consolidate", str(tmp_path), str(tmp_path / "out.pt")])
    assert result.returncode == 2
    assert "is not a sharded checkpoint directory" in result.stderr
    assert not (tmp_path / "out.pt").exists()


def test_a_truncated_sharded_checkpoint_is_a_checkpoint_error(job: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / ".metadata").write_bytes((job / "sharded" / ".metadata").read_bytes()[:20])
    *_, state = _single_device_state()
    with pytest.raises(CheckpointError, match="not a readable sharded checkpoint"):
        Fabric(accelerator="cpu", devices=1).load(broken, state)


# --- construction-time behaviour (no processes) --------------------------------------------------------


def test_fsdp_names_are_registered() -> None:
    assert STRATEGY_REGISTRY.get("fsdp").resolve_target() is FSDPStrategy
    assert STRATEGY_REGISTRY.get("fsdp_cpu_offload").init_kwargs == {"cpu_offload": True}


def test_hybrid_shard_keeps_a_replica_per_node_and_replicate_only_shards_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "NODE_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    hybrid = Fabric(accelerator="cpu", devices=4, num_nodes=2, strategy=FSDPStrategy(hybrid_shard=True)).strategy
    assert hybrid.mesh_plan().resolved_degrees == {  # type: ignore[attr-defined]
        "pipeline_parallel": 1,
        "data_parallel_replicate": 2,
        "data_parallel": 4,
        "context_parallel": 1,
        "tensor_parallel": 1,
    }
    replicated = Fabric(accelerator="cpu", devices=4, strategy=FSDPStrategy(replicate_only=True)).strategy
    assert replicated.mesh_plan().describe() == "data_parallel_replicate=4"  # type: ignore[attr-defined]
    assert Fabric(accelerator="cpu", devices=4, strategy="fsdp").strategy.mesh_plan().describe() == "data_parallel=4"  # type: ignore[attr-defined]


def test_cpu_offload_on_cpu_is_refused_when_fabric_is_built() -> None:
    with pytest.raises(ValueError, match=r"needs an accelerator.*Use strategy='fsdp'"):
        Fabric(accelerator="cpu", strategy="fsdp_cpu_offload", devices=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"state_dict_type": "zip"}, r"state_dict_type='zip' is not valid. Accepted: \['sharded', 'full'\]"),
        ({"shard_modules": "Linear"}, "shard_modules='Linear' is not valid"),
        ({"activation_checkpointing": lambda m: True}, "activation_checkpointing=.* is not valid"),
    ],
)
def test_bad_options_fail_at_construction_naming_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FSDPStrategy(**kwargs)


@pytest.mark.parametrize(
    ("precision", "param_dtype", "reduce_dtype"),
    [
        ("bf16-mixed", torch.bfloat16, torch.float32),
        ("16-mixed", torch.float16, torch.float32),
        ("32-true", None, None),
    ],
)
def test_mixed_precision_policy_comes_from_the_precision_plugin(
    precision: str, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None
) -> None:
    fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=2, precision=precision)
    policy = fabric.strategy.mixed_precision_policy()  # type: ignore[attr-defined]
    assert (policy.param_dtype, policy.reduce_dtype) == (param_dtype, reduce_dtype)


@pytest.mark.parametrize("kind", ["fsdp", "model_parallel"])
def test_load_raw_shards_entries_a_module_renames_as_it_loads(tmp_path: Path, kind: str) -> None:
    """A whole state dict in an older layout, renamed by the modules as they load (litgpt's LoRA layers take
    ``qkv.weight`` for ``qkv.linear.weight``; ``litgpt finetune_lora --devices 2`` loads its base model so): each
    entry reaches its sharded parameter as that rank's shard; torch's own full-state load stopped on ``copy_`` of a
    whole tensor into a DTensor."""
    result = _run([sys.executable, str(SCRIPTS / "fsdp_renamed_load.py"), str(tmp_path), kind])
    assert result.returncode == 0, result.stderr[-4000:]
    expected = {"0.linear.weight": torch.arange(64.0).reshape(8, 8), "0.linear.bias": torch.arange(8.0)}
    expected |= {"2.linear.weight": -expected["0.linear.weight"], "2.linear.bias": -expected["0.linear.bias"]}
    for report in _reports(tmp_path, kind, 2):
        whole = {name.removeprefix("_forward_module."): torch.tensor(value) for name, value in report["whole"].items()}
        assert whole.keys() == expected.keys()
        assert all(torch.equal(whole[name], expected[name]) for name in expected)
        held = {name.removeprefix("_forward_module."): count for name, count in report["held"].items()}
        assert held == {name: tensor.numel() // 2 for name, tensor in expected.items()}  # each rank its half
