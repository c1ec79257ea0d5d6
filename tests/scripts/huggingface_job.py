"""Hugging Face folders from several ranks, for tests/plugins/io/test_huggingface_format.py:
``python huggingface_job.py OUT_DIR save STRATEGY DEVICES [tied] [URL [refused-on-rank-1]] [fails-on-rank-1]``,
``... OUT_DIR save-async STRATEGY DEVICES [fails-on-rank-1]`` or ``... OUT_DIR load STRATEGY DEVICES FOLDER``.

A tiny random-initialised Llama (``transformers``) set up with STRATEGY (``fsdp``, ``hsdp``: 2 replicas of
DEVICES/2 shards, ``ddp`` or ``tp``: tensor parallelism over the MLP projections) on DEVICES gloo ranks. ``save``:
the seed-0 model written to ``OUT_DIR/hf`` (or URL) with ``format="huggingface"`` in files of at most 200 kB
(``tied``: its head tied to its embedding). To a URL, each rank writes the weight files it uploaded to
``OUT_DIR/uploads-rank{rank}.txt``; ``refused-on-rank-1``: rank 1's uploads are refused (``PermissionError``), and each
rank writes the ``CheckpointError`` the save raised to ``OUT_DIR/error-rank{rank}.txt``. ``save-async``: the seed-1
model saved to ``OUT_DIR/hf``, then the seed-0 model with ``async_save=True``, its weights changed in place as soon
as the save returns, then its future waited for. ``fails-on-rank-1`` (to a folder): rank 1 cannot write its shards
(``PermissionError``; in ``save-async`` from its second save on), and each rank writes the error its save or future
raised to ``OUT_DIR/error-rank{rank}.txt``. ``load``: a seed-1 model filled from FOLDER; rank 0 writes its logits on
fixed tokens to ``OUT_DIR/logits.pt``.
"""

import sys
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import LlamaConfig, LlamaForCausalLM

from fabric import Fabric
from fabric.plugins.io.huggingface import FolderUpload
from fabric.strategies import FSDPStrategy, ModelParallelStrategy
from fabric.utilities.exceptions import CheckpointError

out_dir, mode, strategy_name, devices = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
TIED = mode == "save" and "tied" in sys.argv[5:]
TARGET = next((argument for argument in sys.argv[5:] if "://" in argument), out_dir / "hf")
CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=TIED)  # fmt: skip
TOKENS = torch.arange(24).reshape(2, 12) % CONFIG.vocab_size


def split_layers(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    styles = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
    plan = {f"model.layers.{index}.mlp.{name}": style for index in range(2) for name, style in styles.items()}
    return parallelize_module(model, mesh["tensor_parallel"], plan)


def make_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(CONFIG).eval()


strategies = {
    "tp": lambda: ModelParallelStrategy(split_layers, data_parallel_size=1),
    "hsdp": lambda: FSDPStrategy(mesh=(2, devices // 2)),  # replicate x shard
}
strategy = strategies[strategy_name]() if strategy_name in strategies else strategy_name
fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy)
fabric.launch()
REFUSED = "refused-on-rank-1" in sys.argv[5:] and fabric.global_rank == 1
put_weights = FolderUpload.put_weights


def recorded(upload: FolderUpload, tensors: dict[str, torch.Tensor], name: str, dtype: torch.dtype | None) -> None:
    if REFUSED:
        raise PermissionError("Access Denied")
    put_weights(upload, tensors, name, dtype)
    with (out_dir / f"uploads-rank{fabric.global_rank}.txt").open("a") as uploads:
        uploads.write(name + "\n")


FolderUpload.put_weights = recorded  # type: ignore[method-assign]


def refuse_shards_on_rank_1() -> None:
    """With ``fails-on-rank-1``, rank 1 cannot write its shards from now on."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    def refused(*args: object, **kwargs: object) -> None:
        raise PermissionError("Permission denied: the shards' folder")

    if "fails-on-rank-1" in sys.argv[5:] and fabric.global_rank == 1:
        HuggingFaceStorageWriter.write_data = refused  # type: ignore[method-assign,assignment]


if mode == "save-async":
    fabric.save(TARGET, {"model": fabric.setup(make_model(1))}, format="huggingface", max_file_bytes=200_000)
    refuse_shards_on_rank_1()
    model = fabric.setup(make_model(0))
    saved = fabric.save(TARGET, {"model": model}, format="huggingface", max_file_bytes=200_000, async_save=True)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)  # after the save returned: not in the folder
    try:
        saved.result()
    except Exception as error:
        (out_dir / f"error-rank{fabric.global_rank}.txt").write_text(f"{type(error).__name__}: {error}")
    fabric.barrier()  # a rank that ends with code 1 stops the job: every rank has written its error first
elif mode == "save":
    refuse_shards_on_rank_1()
    model = fabric.setup(make_model(0))
    try:
        fabric.save(TARGET, {"model": model}, format="huggingface", max_file_bytes=200_000)
    except CheckpointError as error:
        (out_dir / f"error-rank{fabric.global_rank}.txt").write_text(str(error))
else:
    model = fabric.setup(make_model(1))
    fabric.load(sys.argv[5], {"model": model})
    with torch.no_grad():
        logits = model(input_ids=TOKENS).logits
    if fabric.global_rank == 0:
        torch.save(logits, out_dir / "logits.pt")
