"""HuggingFaceModel: a tiny random GPT-2 and BERT through the Trainer on 1 and 2 ranks, exported for from_pretrained."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch.utils.data import DataLoader

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from fabric.trainer import Trainer  # noqa: E402
from fabric.trainer.huggingface import HuggingFaceModel, write_huggingface_pretrained  # noqa: E402

SCRIPT = Path(__file__).parents[1] / "scripts" / "trainer_huggingface.py"
_spec = importlib.util.spec_from_file_location("trainer_huggingface", SCRIPT)
assert _spec is not None and _spec.loader is not None
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)


def _tokenizer() -> Any:
    """A word-level tokenizer made in memory (no download): words w0..w9, [PAD] is id 0."""
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{index}": index + 2 for index in range(10)}}
    model = tokenizers.models.WordLevel(vocab, unk_token="[UNK]")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")


def test_one_rank_trains_counts_real_tokens_evaluates_and_exports_for_from_pretrained(tmp_path: Path) -> None:
    tokenizer = _tokenizer()
    texts = ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9", "w1", "w2 w3 w4 w5 w6", "w7 w8"] * 2
    encoded = tokenizer(texts, padding="longest", return_tensors="pt")
    labels = encoded["input_ids"].masked_fill(encoded["attention_mask"] == 0, -100)
    rows = [
        {"input_ids": ids, "labels": label}  # no attention_mask: tokens are counted through the tokenizer's pad id
        for ids, label in zip(encoded["input_ids"], labels, strict=True)
    ]
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=12, n_positions=8, bos_token_id=0)
    torch.manual_seed(0)
    model = HuggingFaceModel(transformers.GPT2LMHeadModel(config), tokenizer=tokenizer)
    assert model.shift_labels  # a causal LM
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(rows, batch_size=4),
        eval_dataloader=DataLoader(rows, batch_size=6),
        max_duration="2ep",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-2),
        progress_bar=False,
        accelerator="cpu",
        seed=0,
    )
    trainer.fit()
    real_tokens = int(encoded["attention_mask"].sum())
    assert int(trainer.state.timestamp.token) == 2 * real_tokens
    assert encoded["input_ids"].numel() > real_tokens  # padding was there, and not counted

    model.eval()
    with torch.no_grad():  # the eval metric is the sample-weighted mean of the model's own eval loss
        halves = [model.model(**{key: value[i : i + 6] for key, value in _stacked(rows).items()}).loss for i in (0, 6)]
    assert trainer.state.metrics["metrics/eval/loss"] == pytest.approx(float(sum(halves) / 2), rel=1e-5)

    trainer.save_checkpoint(str(tmp_path / "ckpt.pt"))
    exported = write_huggingface_pretrained(tmp_path / "ckpt.pt", tmp_path / "exported")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(exported)
    ids = encoded["input_ids"][:3]
    torch.testing.assert_close(loaded(ids).logits, model.model(ids).logits)
    reloaded_tokenizer = transformers.AutoTokenizer.from_pretrained(exported)  # saved with the checkpoint
    assert reloaded_tokenizer(texts, padding="longest")["input_ids"] == encoded["input_ids"].tolist()
    assert reloaded_tokenizer.pad_token == "[PAD]"

    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    checkpoint["model"]["_extra_state"]["tokenizer"]["../escaped.json"] = b"{}"
    torch.save(checkpoint, tmp_path / "hostile.pt")
    with pytest.raises(ValueError, match=r"tokenizer file '../escaped.json' that is not a plain file name"):
        write_huggingface_pretrained(tmp_path / "hostile.pt", tmp_path / "out" / "hostile")
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_fabric_consolidate_writes_a_trainer_checkpoint_as_a_folder_the_auto_classes_load(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from fabric_cli.cli import cli

    tokenizer = _tokenizer()
    torch.manual_seed(0)
    model = HuggingFaceModel(script.tiny_gpt2(), tokenizer=tokenizer)
    torch.save({"model": model.state_dict(), "state": {"epoch": 1}}, tmp_path / "ckpt.pt")
    result = CliRunner().invoke(cli, ["consolidate", str(tmp_path / "ckpt.pt"), "--format", "huggingface"])
    assert result.exit_code == 0, result.output
    folder = tmp_path / "ckpt.pt.huggingface"
    assert result.output.startswith(f"wrote {folder} (") and "config.json" in result.output
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert type(loaded) is transformers.GPT2LMHeadModel
    ids = torch.tensor([[2, 3, 4, 5]])
    torch.testing.assert_close(loaded(ids).logits, model.model(ids).logits)
    assert transformers.AutoTokenizer.from_pretrained(folder)("w1 w2")["input_ids"] == tokenizer("w1 w2")["input_ids"]

    state = model.state_dict()
    state["_extra_state"]["tokenizer"]["../escaped.json"] = b"{}"
    torch.save({"model": state}, tmp_path / "hostile.pt")
    refused = CliRunner().invoke(
        cli, ["consolidate", str(tmp_path / "hostile.pt"), str(tmp_path / "out"), "--format", "huggingface"]
    )
    assert refused.exit_code == 1
    assert "tokenizer file '../escaped.json' that is not a plain file name" in refused.output
    assert not (tmp_path / "out").exists()


def test_fabric_consolidate_uploads_the_folder_to_a_bucket(tmp_path: Path, s3_bucket: str) -> None:
    from click.testing import CliRunner

    from fabric_cli.cli import cli

    tokenizer = _tokenizer()
    torch.manual_seed(0)
    model = HuggingFaceModel(script.tiny_gpt2(), tokenizer=tokenizer)
    torch.save({"model": model.state_dict()}, tmp_path / "ckpt.pt")
    url = f"{s3_bucket}/exported"
    result = CliRunner().invoke(cli, ["consolidate", str(tmp_path / "ckpt.pt"), url, "--format", "huggingface"])
    assert result.exit_code == 0, result.output
    assert _bucket_folders(s3_bucket, tmp_path / "copy") == ["exported"]
    folder = tmp_path / "copy" / "exported"
    ids = torch.tensor([[2, 3, 4, 5]])
    torch.testing.assert_close(
        transformers.AutoModelForCausalLM.from_pretrained(folder)(ids).logits, model.model(ids).logits
    )
    assert transformers.AutoTokenizer.from_pretrained(folder)("w1 w2")["input_ids"] == tokenizer("w1 w2")["input_ids"]


def _stacked(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def test_a_classifier_with_a_torchmetrics_metric_and_unshifted_labels() -> None:
    torchmetrics = pytest.importorskip("torchmetrics")
    config = transformers.BertConfig(
        vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, num_labels=3
    )
    torch.manual_seed(0)
    bert = transformers.BertForSequenceClassification(config)
    accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
    model = HuggingFaceModel(bert, eval_metrics={"accuracy": accuracy})
    assert not model.shift_labels
    ids = torch.randint(2, 12, (10, 5), generator=torch.Generator().manual_seed(1))
    rows = [{"input_ids": row, "labels": row[0] % 3} for row in ids]
    trainer = Trainer(
        model=model, eval_dataloader=DataLoader(rows, batch_size=5), progress_bar=False, accelerator="cpu"
    )
    metrics = trainer.eval()
    model.eval()
    with torch.no_grad():
        predictions = bert(input_ids=ids).logits.argmax(dim=-1)
    expected = (predictions == ids[:, 0] % 3).float().mean().item()
    assert metrics == {"metrics/eval/accuracy": pytest.approx(expected)}


def test_one_and_two_ranks_reach_the_same_weights_and_the_checkpoint_loads(tmp_path: Path) -> None:
    (tmp_path / "one").mkdir()
    single = script.train(tmp_path / "one", 1)
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    (tmp_path / "two").mkdir()
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "two"), "2"], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [torch.load(tmp_path / "two" / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert [rank["world_size"] for rank in ranks] == [2, 2]
    assert single["tokens"] == ranks[0]["tokens"] == ranks[1]["tokens"] == 3 * 32 * 8
    for ours, theirs in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(ours, theirs), "parameters differ across ranks"
    for ours, theirs in zip(ranks[0]["params"], single["params"], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)  # gradients averaged, not summed
    assert ranks[0]["eval_loss"] == ranks[1]["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-4)
    assert single["loss"] < 2.9  # it learnt something: a uniform guess over 24 tokens costs ln 24 = 3.18

    loaded = transformers.GPT2LMHeadModel.from_pretrained(
        write_huggingface_pretrained(tmp_path / "two" / "ckpt.pt", tmp_path / "exported")
    )
    for ours, theirs in zip(loaded.parameters(), ranks[0]["params"], strict=True):
        assert torch.equal(ours.detach(), theirs)
    for run, trained in (("one", single), ("two", ranks[0])):  # HuggingFaceCheckpointer's folder after each epoch
        assert sorted(path.name for path in (tmp_path / run / "hf" / "huggingface").iterdir()) == ["ba12", "ba4", "ba8"]
        _assert_folder_holds(tmp_path / run / "hf" / "huggingface" / "ba12", trained["params"])


def _assert_folder_holds(folder: Path, params: list[torch.Tensor]) -> None:
    """``folder`` is a GPT-2 that the Auto classes load, with ``params`` as its parameters."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert type(loaded) is transformers.GPT2LMHeadModel
    for ours, theirs in zip(loaded.parameters(), params, strict=True):
        assert torch.equal(ours.detach(), theirs)


def test_hugging_face_checkpointer_writes_fsdp_shards_from_every_rank_into_one_folder(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "2", "fsdp"], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    _assert_folder_holds(tmp_path / "hf" / "huggingface" / "ba12", ranks[0]["params"])
    (tmp_path / "one").mkdir()
    single = script.train(tmp_path / "one", 1)
    for ours, theirs in zip(ranks[0]["params"], single["params"], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)  # FSDP trained as one process did


def _bucket_folders(url: str, local: Path) -> list[str]:
    """The folders under ``url`` (copied into ``local``), by name."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    fs.get(f"{root}/", str(local), recursive=True)
    return sorted(path.name for path in local.iterdir())


def test_hugging_face_checkpointer_uploads_each_folder_to_a_bucket(tmp_path: Path, s3_bucket: str) -> None:
    single = script.train(tmp_path, 1, hf_folder=f"{s3_bucket}/run")
    assert _bucket_folders(f"{s3_bucket}/run/huggingface", tmp_path / "copy") == ["ba12", "ba4", "ba8"]
    _assert_folder_holds(tmp_path / "copy" / "ba12", single["params"])
    assert not (tmp_path / "hf").exists()


@pytest.mark.end_to_end  # real ranks (gloo): scripts/test.sh --end-to-end
def test_hugging_face_checkpointer_uploads_two_fsdp_ranks_weights_to_a_bucket(
    tmp_path: Path, s3_server: Any, s3_bucket: str
) -> None:
    command = [sys.executable, str(SCRIPT), str(tmp_path), "2", "fsdp", f"{s3_bucket}/run"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=s3_server.environment())
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert _bucket_folders(f"{s3_bucket}/run/huggingface", tmp_path / "copy") == ["ba12", "ba4", "ba8"]
    _assert_folder_holds(tmp_path / "copy" / "ba12", ranks[0]["params"])


def test_hugging_face_checkpointer_refuses_what_it_cannot_write(tmp_path: Path) -> None:
    from fabric.trainer.callbacks import HuggingFaceCheckpointer

    with pytest.raises(ValueError, match=r"precision='fp8': accepted values are \['float32', 'bfloat16', 'float16'\]"):
        HuggingFaceCheckpointer(str(tmp_path), "1ep", precision="fp8")
    with pytest.raises(ValueError, match=r"save_folder='ftp://host/run'\): .*written to an object store"):
        HuggingFaceCheckpointer("ftp://host/run", "1ep")
    with pytest.raises(ValueError, match=r"MLflow registration .* is not provided"):
        HuggingFaceCheckpointer(str(tmp_path), "1ep", mlflow_registered_model_name="gpt")
    from tiny_models import Regressor

    model = Regressor()
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader([(torch.zeros(4), torch.zeros(1))] * 4, batch_size=2),
        max_duration="1ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=[HuggingFaceCheckpointer(str(tmp_path / "hf"), "1ba")],
        progress_bar=False,
        accelerator="cpu",
    )
    with pytest.raises(
        ValueError,
        match=r"writes a HuggingFaceModel \(fabric\.trainer\.huggingface\); the Trainer.s model is a Regressor",
    ):
        trainer.fit()
    assert not (tmp_path / "hf").exists()


def _checkpoint_with_tokenizer_files(path: Path, **files: bytes) -> Path:
    """A one-file checkpoint of a tiny GPT-2 with a tokenizer, plus ``files`` among the tokenizer's files."""
    state = HuggingFaceModel(script.tiny_gpt2(), tokenizer=_tokenizer()).state_dict()
    state["_extra_state"]["tokenizer"].update(files)
    torch.save({"model": state}, path)
    return path


_OWN_FILE = "is the name of one of the model's own files (config, generation config, weights)"


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("vocab\0.json", "holds a NUL byte"),
        ("v" * 300 + ".json", "is longer than the file system allows (255 bytes)"),
        ("config.json", _OWN_FILE),
        ("model.safetensors", _OWN_FILE),
        ("generation_config.json", _OWN_FILE),
    ],
    ids=["NUL", "too long", "config", "weights", "generation config"],
)
def test_a_tokenizer_file_name_that_cannot_be_written_beside_the_model_is_refused_before_anything_is_written(
    name: str, problem: str, tmp_path: Path
) -> None:
    checkpoint = _checkpoint_with_tokenizer_files(tmp_path / "ckpt.pt", **{name: b"{}"})
    with pytest.raises(ValueError) as error:
        write_huggingface_pretrained(checkpoint, tmp_path / "out" / "exported")
    assert str(error.value) == f"{checkpoint} holds a tokenizer file {name!r} that {problem}; nothing was written."
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_entry_that_is_not_a_dict_of_files_is_refused_naming_its_type(tmp_path: Path) -> None:
    """A list there gave ``AttributeError: 'list' object has no attribute 'items'``."""
    state = HuggingFaceModel(script.tiny_gpt2(), tokenizer=_tokenizer()).state_dict()
    state["_extra_state"]["tokenizer"] = [b"{}"]
    torch.save({"model": state}, tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match=r"ckpt.pt holds a tokenizer entry of type list; .* Nothing was written"):
        write_huggingface_pretrained(tmp_path / "ckpt.pt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_export_that_fails_midway_leaves_no_folder_and_keeps_an_existing_one_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = _checkpoint_with_tokenizer_files(tmp_path / "ckpt.pt")
    existing = tmp_path / "existing"
    write_huggingface_pretrained(checkpoint, existing)
    (existing / "README.md").write_text("my notes")
    (existing / "model-00001-of-00002.safetensors").write_bytes(b"a stale shard of an earlier export")
    before = {entry.name: entry.read_bytes() for entry in existing.iterdir()}
    save_pretrained = transformers.GPT2LMHeadModel.save_pretrained

    def disk_fills_after_the_weights(model: Any, folder: Any, **kwargs: Any) -> None:
        save_pretrained(model, folder, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transformers.GPT2LMHeadModel, "save_pretrained", disk_fills_after_the_weights)
    for folder in (tmp_path / "fresh", existing):
        with pytest.raises(OSError, match="No space left on device"):
            write_huggingface_pretrained(checkpoint, folder)
    monkeypatch.undo()
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["ckpt.pt", "existing"]  # no half-written export
    assert {entry.name: entry.read_bytes() for entry in existing.iterdir()} == before

    write_huggingface_pretrained(checkpoint, existing)  # over an existing export: the user's files stay
    assert (existing / "README.md").read_text() == "my notes"
    assert not (existing / "model-00001-of-00002.safetensors").exists()
    assert transformers.AutoTokenizer.from_pretrained(existing).pad_token == "[PAD]"
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["ckpt.pt", "existing"]


def test_wrong_inputs_fail_with_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="wraps a transformers PreTrainedModel, got Linear"):
        HuggingFaceModel(torch.nn.Linear(2, 2))  # type: ignore[arg-type]
    model = HuggingFaceModel(script.tiny_gpt2())
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"returned no loss: the batch needs 'labels' \(it has \['input_ids'\]\)"):
        model.loss(model(batch), batch)
    with pytest.raises(TypeError, match="map input names to tensors"):
        model((torch.zeros(2, 4),))
    other = HuggingFaceModel(
        transformers.BertForMaskedLM(
            transformers.BertConfig(
                vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16
            )
        )
    )
    with pytest.raises(ValueError, match="holds a GPT2LMHeadModel and this HuggingFaceModel wraps a BertForMaskedLM"):
        other.set_extra_state(model.get_extra_state())
    torch.save({"model": {"weight": torch.zeros(1)}}, tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="holds no HuggingFaceModel"):
        write_huggingface_pretrained(tmp_path / "plain.pt", tmp_path / "out")


def _text_rows(tokenizer: Any) -> list[dict[str, torch.Tensor]]:
    texts = ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9", "w1", "w2 w3 w4 w5 w6", "w7 w8"] * 2
    encoded = tokenizer(texts, padding="longest", return_tensors="pt")
    labels = encoded["input_ids"].masked_fill(encoded["attention_mask"] == 0, -100)
    return [
        {"input_ids": ids, "attention_mask": mask, "labels": label}
        for ids, mask, label in zip(encoded["input_ids"], encoded["attention_mask"], labels, strict=True)
    ]


def test_composers_hugging_face_tutorial_fine_tunes_with_metric_lists_and_reloads_from_the_checkpoint(
    tmp_path: Path,
) -> None:
    """Composer's contract: metrics as a list named after their classes (also evaluated when eval_metrics is left
    out), use_logits=True, and hf_from_composer_checkpoint giving back the configured model and the tokenizer."""
    from fabric.trainer.metrics import LanguageCrossEntropy, LanguagePerplexity

    tokenizer, rows = _tokenizer(), _text_rows(_tokenizer())
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=12, n_positions=8, bos_token_id=0)
    torch.manual_seed(0)
    model = HuggingFaceModel(
        transformers.GPT2LMHeadModel(config),
        tokenizer=tokenizer,
        use_logits=True,
        metrics=[LanguageCrossEntropy(), LanguagePerplexity()],
    )
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(rows, batch_size=4),
        eval_dataloader=DataLoader(rows, batch_size=6),
        max_duration="2ep",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-2),
        save_folder=str(tmp_path / "checkpoints"),
        save_filename="ep{epoch}.pt",
        progress_bar=False,
        accelerator="cpu",
        seed=0,
    )
    trainer.fit()
    model.eval()
    with torch.no_grad():  # the logits of position t against the label of t+1, padding left out
        batch = _stacked(rows)
        logits = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        expected = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, 12), batch["labels"][:, 1:].reshape(-1), ignore_index=-100
        ).item()
    assert trainer.state.metrics["metrics/eval/LanguageCrossEntropy"] == pytest.approx(expected, rel=1e-5)
    assert trainer.state.metrics["metrics/eval/LanguagePerplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
    trainer.close()

    checkpoint = tmp_path / "checkpoints" / "ep2.pt"
    hf_model, hf_tokenizer = HuggingFaceModel.hf_from_composer_checkpoint(str(checkpoint))
    assert type(hf_model) is transformers.GPT2LMHeadModel and hf_model.config.n_embd == 16
    assert hf_tokenizer is not None and hf_tokenizer("w1 w2")["input_ids"] == tokenizer("w1 w2")["input_ids"]
    reloaded = HuggingFaceModel(hf_model, tokenizer=hf_tokenizer, use_logits=True, metrics=[LanguageCrossEntropy()])
    evaluator = Trainer(
        model=reloaded,
        eval_dataloader=DataLoader(rows, batch_size=6),
        load_path=str(checkpoint),
        progress_bar=False,
        accelerator="cpu",
    )
    assert evaluator.eval()["metrics/eval/LanguageCrossEntropy"] == pytest.approx(expected, rel=1e-5)

    auto, _ = HuggingFaceModel.hf_from_composer_checkpoint(
        str(checkpoint), "transformers.AutoModelForCausalLM", model_config_kwargs={"n_layer": 2}
    )
    assert type(auto) is transformers.GPT2LMHeadModel and len(auto.transformer.h) == 2


def test_hugging_face_metric_arguments_that_cannot_be_named_are_refused() -> None:
    from fabric.trainer.metrics import LanguageCrossEntropy

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=12))
    with pytest.raises(ValueError, match=r"metrics= holds two LanguageCrossEntropys; pass a dict"):
        HuggingFaceModel(gpt2, metrics=[LanguageCrossEntropy(), LanguageCrossEntropy()])
    with pytest.raises(TypeError, match=r"eval_metrics= takes a list of metrics or a dict"):
        HuggingFaceModel(gpt2, eval_metrics="LanguageCrossEntropy")


def test_generate_logs_the_greedy_continuation_of_each_prompt_at_its_interval_and_at_the_end() -> None:
    """Composer's ``Generate`` callback: at batch 2 and when training ends (batch 3) rank 0 logs the table
    ``generations``; each row is what greedy generation from the trained model gives for that prompt alone (the
    prompts were batched, left-padded); the tokenizer's padding side is restored."""
    from fabric.trainer.callbacks import Generate
    from fabric.trainer.loggers.in_memory import InMemoryLogger

    tokenizer, rows = _tokenizer(), _text_rows(_tokenizer())
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=12, n_positions=16, eos_token_id=1)
    torch.manual_seed(0)
    model = HuggingFaceModel(transformers.GPT2LMHeadModel(config), tokenizer=tokenizer)
    memory, generate = InMemoryLogger(), Generate(["w1 w2 w3", "w4"], interval="2ba", max_new_tokens=3, do_sample=False)
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(rows, batch_size=4),
        max_duration="3ba",
        callbacks=generate,
        loggers=memory,
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-2),
        progress_bar=False,
        accelerator="cpu",
    )
    trainer.fit()
    table = memory.tables["generations"]
    assert generate.last_generate_batch == 3 and table["step"] == 3
    assert table["columns"] == ["prompt", "generation"] and [row[0] for row in table["rows"]] == ["w1 w2 w3", "w4"]
    assert tokenizer.padding_side == "right"
    model.eval()
    for prompt, generation in table["rows"]:
        encoded = tokenizer(prompt, return_tensors="pt")
        tokens = model.model.generate(**encoded, max_new_tokens=3, do_sample=False)[0]
        assert generation == tokenizer.decode(tokens[encoded["input_ids"].shape[1] :], skip_special_tokens=True)
        assert generation.strip()  # something was generated


def test_generate_refuses_a_model_it_cannot_generate_with_and_bad_prompts() -> None:
    from fabric.trainer.callbacks import Generate

    with pytest.raises(ValueError, match=r"Generate\(prompts='hello'\): give a non-empty list of strings"):
        Generate("hello", interval="1ba")
    with pytest.raises(ValueError, match=r"Generate\(batch_size=0\) must be a positive int"):
        Generate(["a"], interval="1ba", batch_size=0)
    from fabric.trainer import ComposerClassifier

    data = [(torch.zeros(2), torch.tensor(0))] * 4
    trainer = Trainer(
        model=ComposerClassifier(torch.nn.Linear(2, 2), num_classes=2),
        train_dataloader=DataLoader(data, batch_size=2),
        max_duration="1ba",
        callbacks=Generate(["a"], interval="1ba"),
        progress_bar=False,
        accelerator="cpu",
    )
    with pytest.raises(ValueError, match=r"Generate needs a HuggingFaceModel with a tokenizer .*ComposerClassifier"):
        trainer.fit()


class _InContextMetric:
    """Stands for llm-foundry's in-context learning metrics (``needs_batch``): records what each update got (in a
    list shared by the Trainer's deep copies) and returns per-sample results, as they do."""

    needs_batch = True
    seen: ClassVar[list[dict[str, Any]]] = []

    def update(self, batch: Any, outputs: Any, labels: Any) -> dict[str, Any]:
        self.seen.append({"batch": dict(batch), "outputs": outputs, "labels": labels})
        return {"result": [1.0] * len(labels)}

    def compute(self) -> torch.Tensor:
        return torch.tensor(1.0)

    def reset(self) -> None:
        pass


def test_in_context_learning_batches_are_evaluated_as_composer_does() -> None:
    """llm-foundry's ICL batches (``mode="icl_task"``, with the task's fields beside the model's inputs): the metric
    gets the batch, the logits of every position, and the labels taken out of the batch one position earlier (the
    last -100), which is where its ``continuation_indices`` read them; a ``mode="generate"`` batch gives the text
    generated after each prompt, its answers as the labels. The task's fields never reach the model."""
    tokenizer = _tokenizer()
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=12, n_positions=16, bos_token_id=0)
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(config)
    model = HuggingFaceModel(gpt2, tokenizer=tokenizer, eval_metrics={"icl": _InContextMetric()}, use_logits=True)
    ids = torch.randint(2, 12, (4, 6), generator=torch.Generator().manual_seed(3))
    icl = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(), "mode": "icl_task",
           "continuation_indices": [torch.tensor([4, 5])] * 4, "gold_indices": [0, 1, 0, 1]}  # fmt: skip
    trainer = Trainer(model=model, eval_dataloader={"eval": [icl]}, progress_bar=False, accelerator="cpu")
    _InContextMetric.seen.clear()
    assert trainer.eval() == {"metrics/eval/icl": 1.0}
    (seen,) = _InContextMetric.seen
    with torch.no_grad():
        expected_logits = gpt2.eval()(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert torch.equal(seen["outputs"], expected_logits)  # every position, as the metric indexes them
    assert torch.equal(seen["labels"][:, :-1], ids[:, 1:]) and (seen["labels"][:, -1] == -100).all()
    assert "labels" not in seen["batch"] and seen["batch"]["gold_indices"] == [0, 1, 0, 1]
    # Composer's State: the batch's per-sample results with the metric's name, and the value by metric name
    assert trainer.state.metric_outputs == {"result": [1.0] * 4, "metric_name": ["_InContextMetric"] * 4}
    assert trainer.state.eval_metric_values == {"icl": 1.0}

    prompts = torch.randint(2, 12, (2, 3), generator=torch.Generator().manual_seed(4))
    generate = {"input_ids": prompts, "attention_mask": torch.ones_like(prompts), "labels": [["w1"], ["w2"]],
                "mode": "generate", "generation_kwargs": {"max_new_tokens": 2, "do_sample": False}}  # fmt: skip
    _InContextMetric.seen.clear()
    trainer.eval(eval_dataloader={"eval": [generate]})
    (seen,) = _InContextMetric.seen
    with torch.no_grad():
        greedy = gpt2.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=2, do_sample=False)
    # this tokenizer encodes " a" as one token, so the text is decoded as it is (Composer adds a space otherwise)
    assert seen["outputs"] == tokenizer.batch_decode(greedy[:, 3:], skip_special_tokens=True)
    assert seen["labels"] == [["w1"], ["w2"]]
