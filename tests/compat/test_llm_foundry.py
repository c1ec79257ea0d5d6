"""llm-foundry 0.22.0, unchanged, through the Composer drop-in mode: its own command line (``llmfoundry train``, the
``train_from_yaml`` that its ``scripts/train/train.py`` calls) trains a tiny random-initialised MPT on text shards and
a tokenizer of the tests' own (``foundry_data.py``), in the environment ``bash scripts/foundry_env.sh`` makes
(``.venv-foundry``, or the interpreter ``FABRIC_FOUNDRY_PYTHON`` names). Without it these skip; under ``CI=true`` they
fail.

What is checked: one process trains 6 batches with evaluations and checkpoints; ``autoresume`` after 3 batches
continues with the uninterrupted run's losses; on 2 processes under ``fabric run model``, with DDP and with
``fsdp_config`` (FULL_SHARD), the logged losses are the one process's (llm-foundry weights microbatches by tokens,
``accumulate_train_batch_on_tokens``, over every rank's batch, and the logged loss is the mean over ranks); a model
built on the meta device takes MPT's own initialisation; ``tp_config`` (tensor parallelism over 2 processes) trains
as one process when its loader replicates the samples over the two ranks, and stops at the first batch when not.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parents[2]
PYTHON = Path(os.environ.get("FABRIC_FOUNDRY_PYTHON", ROOT / ".venv-foundry" / "bin" / "python"))
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
TRAIN_LINE = re.compile(r"^\[epoch=0 batch=(\d+)\] train: loss/train/total: ([-+.\deE]+|nan)", re.MULTILINE)
EVAL_LINE = re.compile(r"^\[epoch=0 batch=(\d+)\] eval: metrics/eval/LanguageCrossEntropy: ([-+.\deE]+|nan)", re.M)

if not PYTHON.exists():
    if os.environ.get("CI") == "true":
        pytest.fail(f"llm-foundry's environment {PYTHON} is missing: bash scripts/foundry_env.sh", pytrace=False)
    pytest.skip("llm-foundry's environment is optional here: bash scripts/foundry_env.sh", allow_module_level=True)

pytestmark = pytest.mark.end_to_end


def _config(workspace: Path, save_folder: Path) -> dict[str, Any]:
    """A tiny MPT (2 layers, 32 wide) on sequences of 64 tokens, 8 per global batch, Composer's cosine schedule with
    2 batches of warm-up, an evaluation and a checkpoint every 3 batches (llm-foundry's own yaml keys)."""
    data = str(workspace / "data")
    dataset = {"local": data, "split": "train", "shuffle": True, "max_seq_len": 64, "shuffle_seed": 17}
    loader = {"name": "text", "drop_last": True, "num_workers": 0, "prefetch_factor": None, "persistent_workers": False,
              "dataset": dataset}  # fmt: skip
    return {
        "run_name": "tiny-mpt",
        "max_seq_len": 64,
        "model": {
            "name": "mpt_causal_lm",
            "init_device": "cpu",
            "d_model": 32,
            "n_heads": 4,
            "n_layers": 2,
            "expansion_ratio": 2,
            "max_seq_len": 64,
            "vocab_size": 256,
            "attn_config": {"attn_impl": "torch"},
            "loss_fn": "torch_crossentropy",
        },
        "tokenizer": {"name": str(workspace / "tokenizer"), "kwargs": {"model_max_length": 64}},
        "train_loader": loader,
        "eval_loader": {
            **loader,
            "drop_last": False,
            "dataset": {**loader["dataset"], "split": "val", "shuffle": False},
        },
        "scheduler": {"name": "cosine_with_warmup", "t_warmup": "2ba", "alpha_f": 0.1},
        "optimizer": {
            "name": "decoupled_adamw",
            "lr": 6.0e-3,
            "betas": [0.9, 0.95],
            "eps": 1.0e-8,
            "weight_decay": 0.0,
        },
        "algorithms": {"gradient_clipping": {"clipping_type": "norm", "clipping_threshold": 1.0}},
        "max_duration": "6ba",
        "eval_interval": "3ba",
        "eval_first": False,
        "eval_subset_num_batches": 2,
        "global_train_batch_size": 8,
        "seed": 17,
        "device_eval_batch_size": 4,
        "device_train_microbatch_size": 4,
        "precision": "fp32",
        "progress_bar": False,
        "log_to_console": True,
        "console_log_interval": "1ba",
        "callbacks": {"lr_monitor": {}, "speed_monitor": {"window_size": 2}},
        "save_folder": str(save_folder),
        "save_interval": "3ba",
        "save_overwrite": True,
        "autoresume": True,
    }


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("foundry")
    job = subprocess.run([str(PYTHON), str(Path(__file__).parent / "foundry_data.py"), str(root)],
                         capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert job.returncode == 0, job.stderr[-3000:]
    return root


def _train(
    workspace: Path, save_folder: Path, *overrides: str, processes: int = 1, **settings: Any
) -> tuple[str, dict[int, float]]:
    """``llmfoundry train CONFIG OVERRIDES`` in the drop-in mode (with ``processes``: under ``fabric run model``; with
    ``settings``: those top-level keys replaced); returns its output and the logged train loss of each batch."""
    config = save_folder.parent / f"{save_folder.name}.yaml"
    settings = _config(workspace, save_folder) | settings
    config.write_text(json.dumps(settings))  # JSON is YAML
    program = ["-m", "llmfoundry.cli.cli", "train", str(config), *overrides]
    if processes == 1:
        command = [str(PYTHON), "-m", "fabric.compat.composer", *program]
    else:
        command = [str(PYTHON), "-m", "fabric_cli", "run", "model", "--drop-in=composer", "-n", str(processes),
                   "--accelerator=cpu", f"--run-dir={save_folder.parent / 'runs'}", *program]  # fmt: skip
    environment = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    job = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment, check=False)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-5000:]
    return output, {int(batch): float(loss) for batch, loss in TRAIN_LINE.findall(output)}


def _with_hf_checkpointer(workspace: Path, save_folder: Path, hf_folder: Path) -> dict[str, Any]:
    """The config's callbacks and llm-foundry's own ``hf_checkpointer``, every 3 batches into ``hf_folder``."""
    hf_checkpointer = {"save_folder": str(hf_folder), "save_interval": "3ba", "precision": "float32"}
    return _config(workspace, save_folder)["callbacks"] | {"hf_checkpointer": hf_checkpointer}


def _assert_hugging_face_folders_hold_the_checkpoints_weights(hf_folder: Path, save_folder: Path) -> None:
    """Folders at batches 3 and 6; the last loads with transformers (MPT's code beside the weights) and holds the
    weights of the run's own checkpoint at batch 6."""
    assert sorted(path.name for path in (hf_folder / "huggingface").iterdir()) == ["ba3", "ba6"]
    compare = (
        "import sys, torch, transformers\n"
        "model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "saved = torch.load(sys.argv[2], weights_only=False)['model']\n"
        "ours = {f'model.{name}': tensor for name, tensor in model.state_dict().items()}\n"
        "print(type(model).__name__, all(torch.equal(ours[name], saved[name]) for name in ours), len(ours))\n"
    )
    arguments = [str(hf_folder / "huggingface" / "ba6"), str(save_folder / "ep0-ba6-rank0.pt")]
    job = subprocess.run([str(PYTHON), "-c", compare, *arguments], capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    name, equal, tensors = job.stdout.split()[-3:]
    assert (name, equal) == ("MPTForCausalLM", "True") and int(tensors) > 10


@pytest.fixture(scope="module")
def uninterrupted(workspace: Path) -> tuple[str, dict[int, float], Path]:
    save_folder = workspace / "uninterrupted"
    callbacks = _config(workspace, save_folder)["callbacks"] | {"fdiff_metrics": {}}  # reads state.eval_metric_values
    output, losses = _train(workspace, save_folder, callbacks=callbacks)
    return output, losses, save_folder


def test_llm_foundry_trains_a_tiny_mpt_unchanged(uninterrupted: tuple[str, dict[int, float], Path]) -> None:
    output, losses, save_folder = uninterrupted
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(loss) for loss in losses.values()) and losses[6] < losses[1] - 0.3
    evaluations = {int(batch): float(value) for batch, value in EVAL_LINE.findall(output)}
    assert sorted(evaluations) == [3, 6] and evaluations[6] < evaluations[3]
    fdiff_line = r"^\[epoch=0 batch=6\] eval: .*metrics/eval/LanguageCrossEntropy_fdiff: ([-+.\deE]+)"
    fdiff = re.search(fdiff_line, output, re.M)  # llm-foundry's fdiff_metrics: the change since the last evaluation
    assert fdiff is not None and float(fdiff.group(1)) == pytest.approx(evaluations[6] - evaluations[3], abs=1e-4)
    assert "lr-DecoupledAdamW/group0: 0.003," in output  # Composer's warm-up: half the peak at batch 2
    assert {path.name for path in save_folder.iterdir()} >= {"ep0-ba3-rank0.pt", "ep0-ba6-rank0.pt", "latest-rank0.pt"}


def test_autoresume_continues_with_the_uninterrupted_losses(
    workspace: Path, uninterrupted: tuple[str, dict[int, float], Path]
) -> None:
    _, reference, _ = uninterrupted
    save_folder = workspace / "resumed"
    _, first = _train(workspace, save_folder, "max_duration=3ba")
    assert sorted(first) == [1, 2, 3]
    _, second = _train(workspace, save_folder)
    assert sorted(second) == [4, 5, 6]  # resumed after batch 3: nothing trained twice, nothing skipped
    assert [second[batch] for batch in (4, 5, 6)] == pytest.approx([reference[batch] for batch in (4, 5, 6)], rel=1e-5)


def test_two_processes_under_fabric_run_model_log_the_one_process_losses_and_write_hugging_face_folders(
    workspace: Path, uninterrupted: tuple[str, dict[int, float], Path]
) -> None:
    """With llm-foundry's own ``hf_checkpointer`` callback too: its Hugging Face folders (MPT's code beside the
    weights) load with transformers and hold the trained weights of the run's own checkpoint."""
    _, reference, _ = uninterrupted
    save_folder, hf_folder = workspace / "two-processes", workspace / "two-processes-hf"
    callbacks = _with_hf_checkpointer(workspace, save_folder, hf_folder)
    output, losses = _train(workspace, save_folder, processes=2, callbacks=callbacks)
    assert "device_train_batch_size: 4" in output  # each rank trains half of the global batch of 8
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    # batches 1 and 2 train from the same weights (the warm-up's learning rate is 0 at batch 1): equal to float
    # precision; later, Adam's division by tiny gradients magnifies the ranks' different summation order
    assert [losses[1], losses[2]] == pytest.approx([reference[1], reference[2]], rel=1e-5)
    assert [losses[batch] for batch in range(3, 7)] == pytest.approx([reference[b] for b in range(3, 7)], rel=1e-3)
    _assert_hugging_face_folders_hold_the_checkpoints_weights(hf_folder, save_folder)


FSDP = {"sharding_strategy": "FULL_SHARD", "mixed_precision": "FULL", "activation_checkpointing": False,
        "activation_cpu_offload": False, "limit_all_gathers": True}  # fmt: skip


def test_fsdp_full_shard_on_two_processes_logs_the_one_process_losses_and_writes_hugging_face_folders(
    workspace: Path, uninterrupted: tuple[str, dict[int, float], Path]
) -> None:
    """llm-foundry's ``fsdp_config`` (FSDP2 here, each rank holding half of every parameter), the model built on the
    CPU: the same training as one process; its ``hf_checkpointer`` gathers the shards into loadable folders."""
    _, reference, _ = uninterrupted
    save_folder, hf_folder = workspace / "fsdp", workspace / "fsdp-hf"
    callbacks = _with_hf_checkpointer(workspace, save_folder, hf_folder)
    _, losses = _train(workspace, save_folder, processes=2, fsdp_config=FSDP, callbacks=callbacks)
    assert [losses[1], losses[2]] == pytest.approx([reference[1], reference[2]], rel=1e-5)
    assert [losses[batch] for batch in range(3, 7)] == pytest.approx([reference[b] for b in range(3, 7)], rel=1e-3)
    _assert_hugging_face_folders_hold_the_checkpoints_weights(hf_folder, save_folder)


def test_fsdp_with_the_model_built_on_the_meta_device_takes_mpts_own_init(
    workspace: Path, uninterrupted: tuple[str, dict[int, float], Path]
) -> None:
    """``model.init_device: meta``: each rank materialises its shards with MPT's ``param_init_fn`` (Composer's
    convention). Drawn in another order than on the CPU, so not the same numbers, but the same init: the first loss
    is the CPU-built model's to within 5% (with each module's ``reset_parameters()`` instead, it was 21, not 6.5)."""
    _, reference, _ = uninterrupted
    _, losses = _train(workspace, workspace / "fsdp-meta", "model.init_device=meta", processes=2, fsdp_config=FSDP)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and all(math.isfinite(loss) for loss in losses.values())
    assert losses[1] == pytest.approx(reference[1], rel=0.05) and losses[6] < losses[1]


def _train_loader(workspace: Path, **dataset: Any) -> dict[str, Any]:
    loader = _config(workspace, workspace)["train_loader"]
    return {**loader, "dataset": {**loader["dataset"], **dataset}}


TP = {"strategy": "ffn", "tensor_parallel_degree": 2}


def test_tensor_parallel_tp_config_trains_as_one_process_given_the_same_batches(workspace: Path) -> None:
    """llm-foundry's ``tp_config`` (its ``ffn`` plan, degree 2) on 2 processes: one model copy whose two halves must
    see the same samples, which its streaming loader gives them with ``replication: 2``. llm-foundry's device batch
    stays the global batch over the world size (4 of 8), so each step trains 4 samples: the losses are one process's
    with a global batch of 4."""
    overrides = {"global_train_batch_size": 4, "max_duration": "4ba", "eval_interval": "4ba", "save_interval": "4ba"}
    _, reference = _train(workspace, workspace / "tp-reference", **overrides)
    replicated = _train_loader(workspace, replication=2)
    overrides["global_train_batch_size"] = 8
    output, losses = _train(
        workspace, workspace / "tp", processes=2, tp_config=TP, train_loader=replicated, **overrides
    )
    assert "device_train_batch_size: 4" in output
    assert sorted(losses) == [1, 2, 3, 4]
    assert [losses[1], losses[2]] == pytest.approx([reference[1], reference[2]], rel=1e-5)
    assert [losses[batch] for batch in (3, 4)] == pytest.approx([reference[b] for b in (3, 4)], rel=1e-3)


def test_tensor_parallel_without_replication_stops_at_the_first_batch_naming_the_cause(workspace: Path) -> None:
    """Without ``replication``, llm-foundry's loader gives the two halves of the model different samples, which would
    train silently away from one process (its ``ffn`` plan all-gathers them, but the attention's gradients are
    never averaged over the tensor-parallel ranks): the first forward refuses it on every rank."""
    save_folder = workspace / "tp-unreplicated"
    config = save_folder.parent / f"{save_folder.name}.yaml"
    config.write_text(json.dumps(_config(workspace, save_folder) | {"tp_config": TP}))
    command = [
        *(str(PYTHON), "-m", "fabric_cli", "run", "model", "--drop-in=composer", "-n", "2", "--accelerator=cpu"),
        *(f"--run-dir={workspace / 'runs-unreplicated'}", "-m", "llmfoundry.cli.cli", "train", str(config)),
    ]
    environment = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    job = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment, check=False)
    assert job.returncode != 0
    said = re.sub(r"\s+", " ", job.stderr.replace("[rank0]: ", ""))  # its rich traceback wraps the lines
    assert "hold parts of one model copy (tensor_parallel=2) and must be given the same batches" in said
    assert "a StreamingDataset takes replication=<ranks of one model copy>" in said
    assert "batch=1]" not in job.stdout  # not one step trained


def _in_context_tasks(folder: Path) -> list[dict[str, Any]]:
    """Three of llm-foundry's in-context learning task types on jsonl files of the tokenizer's words: language
    modelling (12 samples), multiple choice (24 questions of 3 choices, limited to 2 batches of 4 by the eval's
    ``icl_subset_num_batches``) and generation with answers."""
    words = random.Random(5)

    def text(count: int) -> str:
        return " ".join(f"w{words.randrange(200)}" for _ in range(count))

    rows = {
        "lm": [{"context": text(10), "continuation": " " + text(3)} for _ in range(12)],
        "mc": [
            {"query": text(8), "choices": [text(2) for _ in range(3)], "gold": words.randrange(3)} for _ in range(24)
        ],
        "qa": [{"context": text(8), "answer": text(2), "aliases": []} for _ in range(8)],
    }
    for label, samples in rows.items():
        (folder / f"{label}.jsonl").write_text("".join(json.dumps(sample) + "\n" for sample in samples))
    return [
        {"label": "lm", "dataset_uri": str(folder / "lm.jsonl"), "num_fewshot": [0, 1],
         "icl_task_type": "language_modeling",
         "metric_names": ["InContextLearningLMAccuracy", "InContextLearningLMExpectedCalibrationError"]},
        {"label": "mc", "dataset_uri": str(folder / "mc.jsonl"), "num_fewshot": [0],
         "icl_task_type": "multiple_choice", "continuation_delimiter": " ",
         "metric_names": ["InContextLearningMultipleChoiceAccuracy", "InContextLearningMCExpectedCalibrationError"]},
        {"label": "qa", "dataset_uri": str(folder / "qa.jsonl"), "num_fewshot": [0],
         "icl_task_type": "generation_task_with_answers", "generation_kwargs": {"max_new_tokens": 3}},
    ]  # fmt: skip


def test_llmfoundry_eval_of_in_context_tasks_and_the_gauntlet_gives_the_metrics_of_the_batches_by_hand(
    workspace: Path, uninterrupted: tuple[str, dict[int, float], Path]
) -> None:
    """``llmfoundry eval`` on the trained checkpoint with in-context learning tasks and an eval gauntlet: each task's
    metric equals what llm-foundry's own metric gives when the same batches go through the model by hand
    (foundry_icl_reference.py, Composer's way of feeding them), ``icl_subset_num_batches`` included; the generation
    task and the gauntlet's averages are reported."""
    folder = workspace / "icl"
    folder.mkdir(exist_ok=True)
    checkpoint = uninterrupted[2] / "ep0-ba6-rank0.pt"
    model = _config(workspace, checkpoint.parent)["model"]
    benchmarks = [{"name": "mc", "num_fewshot": 0, "random_baseline": 0.33},
                  {"name": "lm", "num_fewshot": 0, "random_baseline": 0.0}]  # fmt: skip
    config = {
        "seed": 17, "precision": "fp32", "max_seq_len": 64, "device_eval_batch_size": 4, "log_config": False,
        "icl_tasks": _in_context_tasks(folder), "icl_subset_num_batches": 2,
        "models": [{"model_name": "tiny-mpt", "model": model, "load_path": str(checkpoint),
                    "tokenizer": {"name": str(workspace / "tokenizer"), "kwargs": {"model_max_length": 64}}}],
        "eval_gauntlet": {"weighting": "EQUAL", "subtract_random_baseline": True, "rescale_accuracy": True,
                          "categories": [{"name": "reading", "benchmarks": benchmarks}]},
    }  # fmt: skip
    config_path = folder / "eval.json"
    config_path.write_text(json.dumps(config))
    environment = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    runner = [str(PYTHON), "-m", "fabric.compat.composer"]
    job = subprocess.run([*runner, "-m", "llmfoundry.cli.cli", "eval", str(config_path)], capture_output=True,
                         text=True, timeout=600, env=environment, check=False)  # fmt: skip
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-5000:]
    reported = {name: float(value) for name, value in re.findall(r"(metrics/\S+): ([-+.\deE]+)", output)}
    reference_path = folder / "reference.json"
    reference_script = str(Path(__file__).parent / "foundry_icl_reference.py")
    job = subprocess.run([*runner, reference_script, str(config_path), str(reference_path)], capture_output=True,
                         text=True, timeout=600, env=environment, check=False)  # fmt: skip
    assert job.returncode == 0, (job.stdout + job.stderr)[-5000:]
    reference = json.loads(reference_path.read_text())
    expected = {"metrics/lm/0-shot/InContextLearningLMAccuracy", "metrics/lm/1-shot/InContextLearningLMAccuracy",
                "metrics/mc/0-shot/InContextLearningMultipleChoiceAccuracy"}  # fmt: skip
    assert expected <= set(reference)
    # the calibration errors read the probabilities at the continuation's positions: a shift of one moves them
    errors = [value for name, value in reference.items() if "CalibrationError" in name]
    assert len(errors) == 3 and all(value > 0.01 for value in errors), reference
    for name, value in reference.items():
        assert reported[name] == pytest.approx(value, abs=1e-6), name
    assert 0.0 <= reported["metrics/qa/0-shot/InContextLearningGenerationExactMatchAccuracy"] <= 1.0
    # 2 batches of 4 of the 24 questions: a multiple of 1/8 (all 24 would be a multiple of 1/24)
    assert reference["metrics/mc/0-shot/InContextLearningMultipleChoiceAccuracy"] * 8 % 1 == pytest.approx(0)
    assert re.search(r"\| tiny-mpt\s+\|\s+[-+.\deE]+ \|\s+[-+.\deE]+ \|", output), output[-3000:]  # the gauntlet
