"""``fabric.save(path, {"model": model}, format="huggingface")`` and ``fabric.load`` of a Hugging Face folder:
real gloo processes (tests/scripts/huggingface_job.py) under FSDP2 and tensor parallelism write a folder that
``transformers`` loads with identical weights, and read a ``save_pretrained`` folder into 2 and 4 ranks with the
reference's logits, also from a bucket of a real S3 API (moto's server); in one process, a save replaces a folder
atomically, and a mismatch (a missing tensor, a wrong shape, a file the index names but lacks) fails naming it with the
model unchanged."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import torch
from object_store import S3Server
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from fabric import Fabric
from fabric.plugins.io.huggingface import INDEX_FILE, STAGING_FOLDER, file_numbers
from fabric.utilities.exceptions import CheckpointError

SCRIPT = Path(__file__).parents[2] / "scripts" / "huggingface_job.py"
CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip
TOKENS = torch.arange(24).reshape(2, 12) % CONFIG.vocab_size


def _model(seed: int) -> LlamaForCausalLM:
    """The job's model (the same config and seeds)."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(CONFIG).eval()


def _job(
    out: Path, *arguments: str, env: dict[str, str] | None = None, returncode: int = 0
) -> subprocess.CompletedProcess[str]:
    out.mkdir(parents=True, exist_ok=True)
    env = {key: value for key, value in (env or os.environ).items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    command = [sys.executable, str(SCRIPT), str(out), *arguments]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == returncode, done.stderr[-4000:]
    return done


def _assert_same_weights(first: nn.Module, second: nn.Module) -> None:
    expected = first.state_dict()
    for name, value in second.state_dict().items():
        assert torch.equal(value, expected[name]), name


@pytest.mark.end_to_end  # real ranks (gloo): scripts/test.sh --end-to-end
@pytest.mark.parametrize(("strategy", "devices"), [("fsdp", "2"), ("tp", "2"), ("ddp", "2"), ("hsdp", "4")])
def test_a_sharded_save_is_a_folder_transformers_loads_with_the_same_weights(
    tmp_path: Path, strategy: str, devices: str
) -> None:
    _job(tmp_path, "save", strategy, devices)
    folder = tmp_path / "hf"
    files = sorted(path.name for path in folder.iterdir())
    assert files == ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX_FILE]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hf"]  # no staging or temporary folder left
    loaded = LlamaForCausalLM.from_pretrained(folder).eval()
    _assert_same_weights(_model(0), loaded)


@pytest.mark.end_to_end  # real ranks (gloo): scripts/test.sh --end-to-end
@pytest.mark.parametrize(("strategy", "devices"), [("fsdp", "2"), ("ddp", "2"), ("tp", "2")])
def test_an_async_save_writes_the_weights_as_they_were_when_it_returned(
    tmp_path: Path, strategy: str, devices: str
) -> None:
    """The weights change in place as soon as ``fabric.save(..., async_save=True)`` returns: the folder, replacing
    the one saved before, has those of the moment of the save, whole, once every rank's future completed."""
    _job(tmp_path, "save-async", strategy, devices)
    folder = tmp_path / "hf"
    files = sorted(path.name for path in folder.iterdir())
    assert files == ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX_FILE]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hf"]  # no staging, temporary or error left
    _assert_same_weights(_model(0), LlamaForCausalLM.from_pretrained(folder).eval())


@pytest.mark.end_to_end  # real ranks (gloo): scripts/test.sh --end-to-end
def test_an_async_save_whose_shards_fail_on_rank_1_fails_every_rank_and_leaves_the_previous_folder(
    tmp_path: Path,
) -> None:
    """And the job ends with code 1, never 0: its last save failed (a scheduler would count it a success)."""
    done = _job(tmp_path, "save-async", "fsdp", "2", "fails-on-rank-1", returncode=1)
    assert "exiting with code 1: the last background save failed" in done.stderr
    errors = [(tmp_path / f"error-rank{rank}.txt").read_text() for rank in range(2)]
    expected = f"{str(tmp_path / 'hf')!r} could not be written: PermissionError: Permission denied: the shards' folder"
    assert errors == [f"CheckpointError: {expected}"] * 2
    assert sorted(path.name for path in tmp_path.iterdir()) == ["error-rank0.txt", "error-rank1.txt", "hf"]
    _assert_same_weights(_model(1), LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval())  # as it was


@pytest.mark.end_to_end  # real ranks (gloo): scripts/test.sh --end-to-end
def test_a_save_whose_shards_fail_on_rank_1_raises_a_checkpoint_error_naming_the_folder_on_every_rank(
    tmp_path: Path,
) -> None:
    """Not DCP's ``CheckpointException``, a ``BaseException`` that ``except Exception`` lets through."""
    _job(tmp_path, "save", "fsdp", "2", "fails-on-rank-1")
    errors = [(tmp_path / f"error-rank{rank}.txt").read_text() for rank in range(2)]
    expected = f"{str(tmp_path / 'hf')!r} could not be written: PermissionError: Permission denied: the shards' folder"
    assert errors == [expected] * 2
    assert sorted(path.name for path in tmp_path.iterdir()) == ["error-rank0.txt", "error-rank1.txt"]


@pytest.mark.end_to_end  # real ranks (gloo): scripts/test.sh --end-to-end
def test_a_tied_head_is_written_once_and_tied_again_by_from_pretrained(tmp_path: Path) -> None:
    _job(tmp_path, "save", "fsdp", "2", "tied")
    index = json.loads((tmp_path / "hf" / INDEX_FILE).read_text())["weight_map"]
    assert "model.embed_tokens.weight" in index and "lm_head.weight" not in index  # as save_pretrained keeps it
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.manual_seed(0)
    expected = LlamaForCausalLM(LlamaConfig(**{**CONFIG.to_dict(), "tie_word_embeddings": True})).eval()
    _assert_same_weights(expected, loaded)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_a_tied_models_folder_from_save_pretrained_loads_strictly_and_stays_tied(tmp_path: Path) -> None:
    tied = LlamaConfig(**{**CONFIG.to_dict(), "tie_word_embeddings": True})
    torch.manual_seed(0)
    LlamaForCausalLM(tied).save_pretrained(tmp_path / "hf")
    fabric = Fabric(accelerator="cpu")
    torch.manual_seed(1)
    target = fabric.setup(LlamaForCausalLM(tied))
    fabric.load(tmp_path / "hf", {"model": target})  # strict: the head is filled through the embedding
    _assert_same_weights(LlamaForCausalLM.from_pretrained(tmp_path / "hf"), target.module)
    assert target.module.lm_head.weight is target.module.model.embed_tokens.weight


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """A folder ``transformers`` wrote in two files, and the logits of the model it holds."""
    folder = tmp_path_factory.mktemp("pretrained")
    model = _model(0)
    model.save_pretrained(folder, max_shard_size="200KB")
    assert (folder / INDEX_FILE).is_file()
    with torch.no_grad():
        return folder, model(input_ids=TOKENS).logits


@pytest.mark.parametrize(
    ("strategy", "devices"), [("fsdp", "2"), ("fsdp", "4"), ("tp", "2"), ("tp", "4"), ("hsdp", "4")]
)
@pytest.mark.end_to_end  # real ranks (gloo): scripts/test.sh --end-to-end
def test_a_transformers_folder_loads_into_sharded_models_each_rank_reading_its_shards(
    tmp_path: Path, pretrained: tuple[Path, torch.Tensor], strategy: str, devices: str
) -> None:
    folder, expected = pretrained
    _job(tmp_path, "load", strategy, devices, str(folder))
    logits = torch.load(tmp_path / "logits.pt")
    assert (logits - expected).abs().max() < 1e-5  # seed 1's model unless every weight was read


def _uploaded(folder: Path, url: str, without: str = "") -> str:
    """``url`` after copying the folder's files (but ``without``) there."""
    fs, root = fsspec.core.url_to_fs(url)
    for file in sorted(folder.iterdir()):
        if file.name != without:
            fs.put_file(str(file), f"{root}/{file.name}")
    return url


@pytest.mark.end_to_end  # real ranks (gloo): scripts/test.sh --end-to-end
def test_a_folder_in_a_bucket_loads_into_a_sharded_model(
    tmp_path: Path, pretrained: tuple[Path, torch.Tensor], s3_server: S3Server, s3_bucket: str
) -> None:
    """Each node's first rank copies the folder to its temporary directory; the ranks read their shards from it."""
    folder, expected = pretrained
    url = _uploaded(folder, f"{s3_bucket}/pretrained")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    _job(tmp_path / "out", "load", "fsdp", "2", url, env=s3_server.environment({"TMPDIR": str(scratch)}))
    logits = torch.load(tmp_path / "out" / "logits.pt")
    assert (logits - expected).abs().max() < 1e-5
    assert list(scratch.iterdir()) == []  # the copy is gone


def test_one_process_loads_a_folder_from_a_bucket_and_removes_its_copy(
    tmp_path: Path, pretrained: tuple[Path, torch.Tensor], s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, _ = pretrained
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    fabric = Fabric(accelerator="cpu")
    target = fabric.setup(_model(1))
    fabric.load(_uploaded(folder, f"{s3_bucket}/pretrained"), {"model": target})
    _assert_same_weights(_model(0), target.module)
    assert list(tmp_path.iterdir()) == []
    broken = _uploaded(folder, f"{s3_bucket}/broken", without="model-00002-of-00002.safetensors")
    _unchanged_after(
        r"its index names model-00002-of-00002\.safetensors, which is not there; nothing was loaded", broken
    )
    assert list(tmp_path.iterdir()) == []


def _bucket_files(url: str) -> list[str]:
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return sorted(path.rsplit("/", 1)[1] for path in fs.find(root))


def _downloaded(url: str, local: Path) -> Path:
    fs, root = fsspec.core.url_to_fs(url)
    fs.get(f"{root}/", str(local), recursive=True)
    return local


@contextlib.contextmanager
def _refused(request: str) -> Iterator[None]:
    """s3fs's ``request`` (one of its async methods: ``_pipe_file``, ``_rm``) refused with Access Denied meanwhile."""
    import s3fs

    async def refused(*args: object, **kwargs: object) -> None:
        raise PermissionError("Access Denied")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(s3fs.S3FileSystem, request, refused)
        s3fs.S3FileSystem.clear_instance_cache()  # a cached client keeps the methods it was made with
        try:
            yield
        finally:
            s3fs.S3FileSystem.clear_instance_cache()


def test_one_process_saves_to_a_bucket_replacing_the_previous_folder_at_its_index(
    tmp_path: Path, s3_bucket: str
) -> None:
    fabric = Fabric(accelerator="cpu")
    url = f"{s3_bucket}/exported"
    fabric.save(url, {"model": fabric.setup(_model(1))}, format="huggingface")  # one file
    fabric.save(url, {"model": fabric.setup(_model(0))}, format="huggingface", max_file_bytes=150_000)
    files = _bucket_files(url)
    index = json.loads(fsspec.open(f"{url}/{INDEX_FILE}").open().read())
    weight_files = sorted(set(index["weight_map"].values()))
    assert len(weight_files) > 1 and files == sorted(["config.json", INDEX_FILE, *weight_files])  # the first's gone
    assert all(re.fullmatch(r"model-[0-9a-f]{16}-0000\d-of-0000\d\.safetensors", name) for name in weight_files)
    _assert_same_weights(_model(0), LlamaForCausalLM.from_pretrained(_downloaded(url, tmp_path / "copy")))
    target = fabric.setup(_model(1))
    fabric.load(url, {"model": target})
    _assert_same_weights(_model(0), target.module)


def test_a_save_to_a_bucket_that_fails_before_its_index_leaves_the_previous_folder(
    tmp_path: Path, s3_bucket: str
) -> None:
    fabric = Fabric(accelerator="cpu")
    url = f"{s3_bucket}/exported"
    fabric.save(url, {"model": fabric.setup(_model(0))}, format="huggingface", max_file_bytes=150_000)
    before = _bucket_files(url)
    with _refused("_pipe_file"), pytest.raises(CheckpointError, match=r"exported' failed on rank 0 \(PermissionError"):
        fabric.save(url, {"model": fabric.setup(_model(1))}, format="huggingface", max_file_bytes=150_000)
    assert _bucket_files(url) == before  # the new weight files removed, the previous folder whole
    _assert_same_weights(_model(0), LlamaForCausalLM.from_pretrained(_downloaded(url, tmp_path / "copy")))


def test_a_refused_deletion_after_the_index_switched_warns_and_the_new_folder_stands(
    tmp_path: Path, s3_bucket: str
) -> None:
    fabric = Fabric(accelerator="cpu")
    url = f"{s3_bucket}/exported"
    fabric.save(url, {"model": fabric.setup(_model(1))}, format="huggingface", max_file_bytes=150_000)
    replaced = [name for name in _bucket_files(url) if name.endswith(".safetensors")]
    with _refused("_rm"), pytest.warns(UserWarning, match=r"is saved, but deleting what it replaced failed \(Perm"):
        fabric.save(url, {"model": fabric.setup(_model(0))}, format="huggingface", max_file_bytes=150_000)
    assert set(replaced) <= set(_bucket_files(url))  # left beside the new folder, which the index names
    _assert_same_weights(_model(0), LlamaForCausalLM.from_pretrained(_downloaded(url, tmp_path / "copy")))


def test_a_save_to_a_bucket_deletes_what_killed_uploads_left_once_an_hour_old(
    s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fabric.plugins.io import huggingface

    fabric = Fabric(accelerator="cpu")
    url = f"{s3_bucket}/exported"
    left = "model-0123456789abcdef-00001-of-00002.safetensors"  # an upload killed before its index
    fsspec.open(f"{url}/{left}", "wb").open().close()
    fabric.save(url, {"model": fabric.setup(_model(0))}, format="huggingface")
    assert left in _bucket_files(url)  # young: it may belong to an upload still running
    monkeypatch.setattr(huggingface, "ABANDONED_AFTER", 0.0)
    fabric.save(url, {"model": fabric.setup(_model(1))}, format="huggingface")
    files = _bucket_files(url)
    assert left not in files and len(files) == 3  # config, index and this save's one weight file


@pytest.mark.end_to_end  # real ranks (gloo): scripts/test.sh --end-to-end
@pytest.mark.parametrize(("strategy", "devices"), [("fsdp", "2"), ("ddp", "2"), ("hsdp", "4")])
def test_a_sharded_save_to_a_bucket_is_a_folder_transformers_loads_each_rank_uploading_its_files(
    tmp_path: Path, s3_server: S3Server, s3_bucket: str, strategy: str, devices: str
) -> None:
    """No rank gathers the model: each uploads the weight files it owns (file i is rank (i - 1) % world size's)."""
    url = f"{s3_bucket}/exported"
    _job(tmp_path, "save", strategy, devices, url, env=s3_server.environment())
    uploads = {path.name: path.read_text().split() for path in tmp_path.iterdir()}
    assert {"config.json", INDEX_FILE} <= set(_bucket_files(url))
    index = json.loads(fsspec.open(f"{url}/{INDEX_FILE}").open().read())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 2  # at most 200 kB each
    owners = {rank: files[rank :: int(devices)] for rank in range(int(devices))}  # hsdp: ranks 2 and 3 own none
    assert uploads == {f"uploads-rank{rank}.txt": names for rank, names in owners.items() if names}
    assert set(_bucket_files(url)) == {"config.json", INDEX_FILE, *files}
    _assert_same_weights(_model(0), LlamaForCausalLM.from_pretrained(_downloaded(url, tmp_path / "copy")).eval())


@pytest.mark.end_to_end  # real ranks (gloo): scripts/test.sh --end-to-end
def test_an_upload_refused_on_rank_1_fails_every_rank_naming_it_and_leaves_the_previous_folder(
    tmp_path: Path, s3_server: S3Server, s3_bucket: str
) -> None:
    url = f"{s3_bucket}/exported"
    _job(tmp_path / "first", "save", "fsdp", "2", url, env=s3_server.environment())
    before = _bucket_files(url)
    _job(tmp_path / "refused", "save", "fsdp", "2", url, "refused-on-rank-1", env=s3_server.environment())
    for rank in (0, 1):
        error = (tmp_path / "refused" / f"error-rank{rank}.txt").read_text()
        assert "exported' failed on rank 1 (PermissionError: Access Denied); a folder there is as it was" in error
    assert (tmp_path / "refused" / "uploads-rank0.txt").read_text().count(".safetensors") == 1  # put up, then deleted
    assert _bucket_files(url) == before
    _assert_same_weights(_model(0), LlamaForCausalLM.from_pretrained(_downloaded(url, tmp_path / "copy")).eval())


def test_one_process_saves_replaces_the_previous_folder_and_loads_back(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu")
    folder = tmp_path / "exported"
    fabric.save(folder, {"model": fabric.setup(_model(1))}, format="huggingface")
    fabric.save(folder, {"model": fabric.setup(_model(0))}, format="huggingface", max_file_bytes=150_000)
    assert len(json.loads((folder / INDEX_FILE).read_text())["weight_map"]) == len(_model(0).state_dict())
    assert not (folder / STAGING_FOLDER).exists() and sorted(p.name for p in tmp_path.iterdir()) == ["exported"]
    target = fabric.setup(_model(1))
    fabric.load(folder, {"model": target})
    _assert_same_weights(_model(0), target.module)
    _assert_same_weights(_model(0), LlamaForCausalLM.from_pretrained(folder))


def test_one_process_saves_in_the_background_the_weights_of_the_moment_it_returned(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu")
    folder = tmp_path / "exported"
    fabric.save(folder, {"model": fabric.setup(_model(1))}, format="huggingface")
    model = fabric.setup(_model(0))
    saved = fabric.save(folder, {"model": model}, format="huggingface", async_save=True)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    saved.result()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]
    _assert_same_weights(_model(0), LlamaForCausalLM.from_pretrained(folder))


def _unchanged_after(error: str, folder: Path | str, strict: bool = True) -> None:
    fabric = Fabric(accelerator="cpu")
    target = fabric.setup(_model(1))
    with pytest.raises(CheckpointError, match=error):
        fabric.load(folder, {"model": target}, strict=strict)
    _assert_same_weights(_model(1), target.module)


def test_a_mismatched_folder_fails_naming_the_tensor_and_changes_nothing(
    tmp_path: Path, pretrained: tuple[Path, torch.Tensor]
) -> None:
    smaller = LlamaConfig(**{**CONFIG.to_dict(), "num_hidden_layers": 1})
    torch.manual_seed(0)
    LlamaForCausalLM(smaller).save_pretrained(tmp_path / "one-layer")
    _unchanged_after(
        r"has no 'model\.layers\.1\.input_layernorm\.weight' \(9 of the model's tensors", tmp_path / "one-layer"
    )
    wider = LlamaConfig(**{**CONFIG.to_dict(), "intermediate_size": 96})
    LlamaForCausalLM(wider).save_pretrained(tmp_path / "wider")
    _unchanged_after(
        r"'model\.layers\.0\.mlp\.down_proj\.weight' has shape \[64, 96\] there and \[64, 128\]", tmp_path / "wider"
    )
    folder, _ = pretrained
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / INDEX_FILE).write_text((folder / INDEX_FILE).read_text())
    (broken / "model-00001-of-00002.safetensors").write_bytes(
        (folder / "model-00001-of-00002.safetensors").read_bytes()
    )
    _unchanged_after(r"its index names model-00002-of-00002\.safetensors, which is not there", broken)


def test_strict_false_loads_the_tensors_both_have(tmp_path: Path) -> None:
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**CONFIG.to_dict(), "num_hidden_layers": 1})).save_pretrained(tmp_path)
    fabric = Fabric(accelerator="cpu")
    target = fabric.setup(_model(1))
    fabric.load(tmp_path, {"model": target}, strict=False)
    saved = LlamaForCausalLM.from_pretrained(tmp_path).state_dict()
    untouched = _model(1).state_dict()
    for name, value in target.module.state_dict().items():
        assert torch.equal(value, saved[name] if name in saved else untouched[name]), name


def test_what_cannot_be_a_hugging_face_folder_is_refused_in_one_line(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu")
    model = fabric.setup(_model(0))
    with pytest.raises(ValueError, match=r"format='gguf'\): accepted formats are \['huggingface'\]"):
        fabric.save(tmp_path / "x", {"model": model}, format="gguf")
    with pytest.raises(
        ValueError, match=r"takes state=\{'model': model\}, one module; got state with keys \['model', 'step'\]"
    ):
        fabric.save(tmp_path / "x", {"model": model, "step": 3}, format="huggingface")
    with pytest.raises(ValueError, match=r"takes no filter= \(it writes the model's weights\)"):
        fabric.save(tmp_path / "x", {"model": model}, format="huggingface", filter={"model": lambda *_: True})
    with pytest.raises(ValueError, match=r"async_save=True writes a Hugging Face folder on a file system; 's3://b/x'"):
        fabric.save("s3://b/x", {"model": model}, format="huggingface", async_save=True)
    with pytest.raises(ValueError, match=r"written to an object store \(.*s3.*\), .*; 'ftp://host/x' is not one"):
        fabric.save("ftp://host/x", {"model": model}, format="huggingface")
    fabric.save(tmp_path / "hf", {"model": model}, format="huggingface")
    with pytest.raises(
        ValueError, match=r"Loading a Hugging Face folder takes state=\{'model': model\}, one module; got no state"
    ):
        fabric.load(tmp_path / "hf")
    assert not (tmp_path / "x").exists()


def test_deepspeed_refuses_hugging_face_folders_by_name(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu", strategy="deepspeed")
    with pytest.raises(ValueError, match=r"Saving a Hugging Face folder: DeepSpeed's engine holds the parameters"):
        fabric.save(tmp_path / "hf", {"model": nn.Linear(2, 2)}, format="huggingface")
    assert not (tmp_path / "hf").exists()


def test_weight_files_split_as_save_pretrained_splits_them() -> None:
    assert file_numbers({"a": 60, "b": 50, "c": 120, "d": 10}, max_file_bytes=100) == {"a": 1, "b": 2, "c": 3, "d": 4}
    assert file_numbers({"a": 40, "b": 60, "c": 20}, max_file_bytes=100) == {"a": 1, "b": 1, "c": 2}


class _Wrapped(nn.Module):
    """A model whose tensors carry a prefix a ``transformers`` folder does not have."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.backbone = _model(seed)


def test_key_mapping_renames_the_folders_tensors_to_the_models_names(
    tmp_path: Path, pretrained: tuple[Path, torch.Tensor]
) -> None:
    folder, _ = pretrained
    fabric = Fabric(accelerator="cpu")
    target = fabric.setup(_Wrapped(1))
    with pytest.raises(CheckpointError, match=r"has no 'backbone\.lm_head\.weight'.*or key_mapping= to rename"):
        fabric.load(folder, {"model": target})
    _assert_same_weights(_model(1), target.module.backbone)
    # the first matching pattern wins, as in transformers: 'lm_head' is renamed by the first, never the second
    fabric.load(folder, {"model": target}, key_mapping={r"^lm_head\.": "backbone.lm_head.", r"^": "backbone."})
    _assert_same_weights(_model(0), target.module.backbone)


def test_a_bad_key_mapping_is_refused_before_anything_is_read(
    tmp_path: Path, pretrained: tuple[Path, torch.Tensor]
) -> None:
    folder, _ = pretrained
    fabric = Fabric(accelerator="cpu")
    target = fabric.setup(_model(1))
    with pytest.raises(CheckpointError, match=r"key_mapping renames both 'lm_head\.weight' and 'model\.norm\.weight'"):
        fabric.load(folder, {"model": target}, key_mapping={r"^(lm_head|model\.norm)\.weight$": "model.norm.weight"})
    with pytest.raises(ValueError, match=r"key_mapping: '\(unclosed' is not a regular expression"):
        fabric.load(folder, {"model": target}, key_mapping={"(unclosed": "x"})
    _assert_same_weights(_model(1), target.module)
    fabric.save(tmp_path / "ckpt.pt", {"model": target})
    with pytest.raises(ValueError, match=r"renames the tensors of a Hugging Face folder; .*ckpt\.pt' is not one"):
        fabric.load(tmp_path / "ckpt.pt", {"model": target}, key_mapping={"a": "b"})
