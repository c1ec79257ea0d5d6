"""A tiny randomly initialised GPT-2 trained by the Trainer: ``python trainer_huggingface.py OUT_DIR DEVICES
[STRATEGY [HF_FOLDER]]`` (``ddp`` by default on several ranks, or ``fsdp``).

No download: the config is built here. The global batch is 8 whatever the number of ranks and every
sequence is full length, so one process and two DDP or FSDP ranks reach the same weights. Each rank saves
what it computed to ``OUT_DIR/rank{rank}.pt`` (whole tensors); all ranks save a Trainer checkpoint to
``OUT_DIR/ckpt.pt`` and, with a ``HuggingFaceCheckpointer`` every epoch, Hugging Face folders to
``OUT_DIR/hf/huggingface/ba{batch}`` (``HF_FOLDER/huggingface/ba{batch}`` when given: a URL, say).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from fabric.trainer.callbacks import HuggingFaceCheckpointer
from fabric.trainer.huggingface import HuggingFaceModel
from fabric.trainer.trainer import Trainer

VOCAB, LENGTH = 24, 8


def tiny_gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=LENGTH, bos_token_id=0, eos_token_id=0
    )
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return GPT2LMHeadModel(config)


def sequences(count: int) -> list[dict[str, torch.Tensor]]:
    """Counting sequences (a learnable pattern): token t+1 follows token t, from a random start."""
    starts = torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(3))
    rows = [(start + torch.arange(LENGTH)) % VOCAB for start in starts]
    return [{"input_ids": row, "attention_mask": torch.ones(LENGTH, dtype=torch.long), "labels": row} for row in rows]


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (FSDP shards it), else the tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def train(out_dir: Path, devices: int, strategy: str = "ddp", hf_folder: str | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = HuggingFaceModel(tiny_gpt2())
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(sequences(32), batch_size=8 // devices),
        eval_dataloader=DataLoader(sequences(8), batch_size=4),
        max_duration="3ep",
        # SGD, not Adam: Adam's normalisation would hide a wrongly scaled gradient average across ranks.
        optimizers=torch.optim.SGD(model.parameters(), lr=1.0),
        progress_bar=False,
        seed=0,
        accelerator="cpu",
        strategy=strategy if devices > 1 else "auto",
        devices=devices,
        callbacks=[HuggingFaceCheckpointer(hf_folder or str(out_dir / "hf"), "1ep")],
    )
    trainer.fit()
    trainer.save_checkpoint(str(out_dir / "ckpt.pt"))
    result = {
        "world_size": trainer.fabric.world_size,
        "params": [whole(p.detach()).clone() for p in model.parameters()],
        "tokens": int(trainer.state.timestamp.token),
        "eval_loss": trainer.state.metrics["metrics/eval/loss"],
        "loss": float(trainer.state.loss),
    }
    torch.save(result, out_dir / f"rank{trainer.fabric.global_rank}.pt")
    trainer.close()
    return result


if __name__ == "__main__":
    train(Path(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])
