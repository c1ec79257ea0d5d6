"""``python trainer_token_accumulation.py OUT_DIR DEVICES MICROBATCH [samples]``: one SGD step of a tiny language
model with ``accumulate_train_batch_on_tokens=True`` (``samples``: False) on a global batch of 8 sequences whose
labels are padded unevenly (sequence i has i + 1 loss-generating tokens). With ``DEVICES=2`` constructing the Trainer
starts rank 1 and each rank trains its half. Each rank saves its weights to ``OUT_DIR/rank<R>.pt``. ``DEVICES=0``:
the reference, plain PyTorch, one step on the mean loss over every loss-generating token of the 8 sequences."""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fabric.trainer import ComposerModel, Trainer

out_dir, devices, microbatch = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
VOCAB, LENGTH, IGNORE = 11, 8, -100


def global_batch() -> dict[str, torch.Tensor]:
    """8 sequences; sequence i has i + 1 loss-generating positions at its end (the rest are padding)."""
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, VOCAB, (8, LENGTH), generator=generator)
    labels = torch.randint(0, VOCAB, (8, LENGTH), generator=generator)
    for row in range(8):
        labels[row, : LENGTH - (row % LENGTH) - 1] = IGNORE
    return {"input_ids": input_ids, "labels": labels}  # on 2 ranks (every other sequence): 16 and 20 tokens


class Sequences(Dataset):
    def __init__(self) -> None:
        self.batch = global_batch()

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value[index] for key, value in self.batch.items()}


class TinyLanguageModel(ComposerModel):
    """Each microbatch's loss is its mean over its own loss-generating tokens, as a causal LM's is."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 6)
        self.head = nn.Linear(6, VOCAB)

    def forward(self, batch):
        return self.head(torch.tanh(self.embedding(batch["input_ids"])))

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=IGNORE)


def count_tokens(batch):
    return {"total": batch["input_ids"].numel(), "loss_generating": int((batch["labels"] != IGNORE).sum())}


torch.manual_seed(0)
model = TinyLanguageModel()
if devices == 0:
    batch = global_batch()
    model.loss(model(batch), batch).backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    torch.save({"params": [p.detach().clone() for p in model.parameters()]}, out_dir / "rank0.pt")
    sys.exit(0)
trainer = Trainer(
    model=model,
    train_dataloader=DataLoader(Sequences(), batch_size=8 // devices, shuffle=False),
    optimizers=torch.optim.SGD(model.parameters(), lr=1.0),
    max_duration="1ba",
    device_train_microbatch_size=microbatch,
    get_num_tokens_in_batch=count_tokens,
    accumulate_train_batch_on_tokens="samples" not in sys.argv[4:],
    accelerator="cpu",
    devices=devices,
    strategy="ddp" if devices > 1 else "auto",
    progress_bar=False,
)
trainer.fit()
rank = trainer.fabric.global_rank
torch.save(
    {"params": [p.detach().clone() for p in model.parameters()], "tokens": int(trainer.state.timestamp.token)},
    out_dir / f"rank{rank}.pt",
)
