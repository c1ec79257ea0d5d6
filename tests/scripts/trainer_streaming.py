"""The Trainer over resumable data: ``trainer_streaming.py OUT_DIR DEVICES CRASH_AT RUN [map BATCH [SAMPLES [TP]]]``.

DEVICES ranks (an in-script launch) train 3 epochs over the 64 samples of ``StreamingLikeDataset`` in batches of
4, or with ``map`` over a map-style dataset of SAMPLES (default 64) in a shuffling DataLoader with batches of
BATCH (with TP > 1: tensor parallelism of that degree through Composer's ``parallelism_config``, the ranks of a
tensor-parallel group training one batch; only the group's first rank logs its ids), or with ``mds SHARDS`` over
real MDS shards with mosaicml-streaming's ``StreamingDataset`` and ``StreamingDataLoader`` (written there by
``trainer_streaming.py write SHARDS``; only in the environment of ``scripts/streaming_env.sh``); they checkpoint
every batch into OUT_DIR/ckpt and auto-resume from it. Every rank appends the ids it trained, with their epoch, to
OUT_DIR/ids-RUN-rankR.txt. With CRASH_AT > 0 every rank dies (exit 17) right after the checkpoint of batch
CRASH_AT, before fetching the next batch: nothing trained is lost, nothing logged twice.
"""

import os
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from streaming_double import StreamingLikeDataset, StreamingLikeLoader
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader, Dataset

from fabric import Fabric
from fabric.trainer import Trainer
from fabric.trainer.core.callback import Callback


def import_streaming():
    """mosaicml-streaming, whose vision datasets need torchvision's CUDA operators: stubbed out here."""
    sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    import streaming

    return streaming


if sys.argv[1] == "write":
    streaming = import_streaming()
    with streaming.MDSWriter(out=sys.argv[2], columns={"id": "int"}, size_limit=256) as writer:
        for sample_id in range(64):
            writer.write({"id": sample_id})
    sys.exit(0)

out_dir, devices, crash_at, run = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
kind = sys.argv[5] if len(sys.argv) > 5 else "double"


class Samples(Dataset):
    """A map-style dataset of samples ``{"id": i, ...}``."""

    def __init__(self, count):
        self.count = count

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        return with_features({"id": index})


def with_features(sample):
    sample_id = int(sample["id"])
    return {"id": sample_id, "x": torch.full((4,), float(sample_id)), "y": torch.tensor([float(sample_id % 3)])}


if kind == "map":
    samples = int(sys.argv[7]) if len(sys.argv) > 7 else 64
    train_dataloader = DataLoader(Samples(samples), batch_size=int(sys.argv[6]), shuffle=True)
elif kind == "mds":
    streaming = import_streaming()
    from streaming.base.util import clean_stale_shared_memory

    class Shards(streaming.StreamingDataset):
        def get_item(self, index):
            return with_features(super().get_item(index))

    # A StreamingDataset learns its rank when it is built: start the ranks first (rank 0 then has RANK too).
    fabric = Fabric(accelerator="cpu", devices=devices)
    fabric.launch()
    clean_stale_shared_memory()  # what a crashed run left (a collective: after the launch)
    dataset = Shards(local=sys.argv[6], batch_size=4, shuffle=True, shuffle_seed=0)
    train_dataloader = streaming.StreamingDataLoader(dataset, batch_size=4)
else:
    train_dataloader = StreamingLikeLoader(StreamingLikeDataset(64), batch_size=4)


tensor_parallel = int(sys.argv[8]) if len(sys.argv) > 8 else 1


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, batch):
        return self.net(batch["x"])

    def loss(self, outputs, batch):
        return F.mse_loss(outputs, batch["y"])


class LogIdsThenCrash(Callback):
    def batch_end(self, state, logger):
        rank = state.fabric.global_rank
        if rank % tensor_parallel:
            return  # the group's first rank logs the batch they trained together
        with open(out_dir / f"ids-{run}-rank{rank}.txt", "a") as log:
            for sample_id in state.batch["id"].tolist():
                log.write(f"{int(state.timestamp.epoch)} {sample_id}\n")

    def before_dataloader(self, state, logger):
        if crash_at and int(state.timestamp.batch) == crash_at:
            os._exit(17)


torch.manual_seed(0)
model = Regressor()
tp_section = {
    "tensor_parallel_degree": tensor_parallel,
    "layer_plan": {"net.0": ColwiseParallel(), "net.2": RowwiseParallel()},
}
trainer = Trainer(
    model=model,
    train_dataloader=train_dataloader,
    max_duration="3ep",
    optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
    callbacks=[LogIdsThenCrash()],
    save_folder=str(out_dir / "ckpt"),
    save_interval="1ba",
    save_overwrite=True,
    save_num_checkpoints_to_keep=1,
    run_name="streaming",
    autoresume=True,
    progress_bar=False,
    seed=0,
    **({"fabric": fabric} if kind == "mds" else {"accelerator": "cpu", "devices": devices}),
    **({"parallelism_config": {"tp": tp_section}} if tensor_parallel > 1 else {}),
)
trainer.fit()
