"""Time to the first batch when resuming mid-epoch: skipping by index vs replaying the finished batches.

The dataset is map-style and does per-sample work like a real image pipeline (a 3x32x32 image drawn
from a per-index generator, normalized, blurred, sometimes flipped). The loader shuffles
(``RandomSampler`` with a ``torch.Generator``), collates batches of 8, runs in the main process
(``num_workers=0``) and is wrapped by Fabric, as the Trainer's loader is. One thread.

Measured, each on a freshly built loader after the epoch start was captured:

- resume_iterator: ``next(resume_iterator(loader, epoch_start, batches_done))``;
- replay: ``it = iter(loader)``, then ``next(it)`` ``batches_done + 1`` times (what Composer does);
- uninterrupted: the per-batch time of a plain pass over the first batches, for reference.

Each time is the median over the repeats. Both resumes must yield the same first batch (checked).

Usage::

    python benchmarks/resume.py           # 20,000 batches per epoch, resume at 10,000: about a minute
    python benchmarks/resume.py --quick   # 2,000 batches, resume at 1,000: a few seconds
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from fabric.trainer.checkpoint.dataloader_position import capture_epoch_start, resume_iterator
from fabric.wrappers import wrap_dataloader

BATCH_SIZE = 8
SEED = 1234


class Images(Dataset[tuple[torch.Tensor, int]]):
    """``length`` synthetic 3x32x32 images; building each costs a few tens of microseconds of real work."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(index))
        image = (image - image.mean(dim=(1, 2), keepdim=True)) / image.std(dim=(1, 2), keepdim=True)
        image = F.avg_pool2d(image, kernel_size=3, stride=1, padding=1)
        if index % 2:
            image = image.flip(-1)
        return image, index % 10


def build_loader(batches_per_epoch: int) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(SEED)
    loader = DataLoader(
        Images(batches_per_epoch * BATCH_SIZE), batch_size=BATCH_SIZE, shuffle=True, generator=generator
    )
    return wrap_dataloader(loader, device=None)


def first_batch_by_resume(batches_per_epoch: int, epoch_start: dict[str, Any], batches_done: int) -> Any:
    return next(resume_iterator(build_loader(batches_per_epoch), epoch_start, batches_done))


def first_batch_by_replay(batches_per_epoch: int, batches_done: int) -> Any:
    batches = iter(build_loader(batches_per_epoch))
    for _ in range(batches_done):
        next(batches)
    return next(batches)


def timed(run: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Median seconds over ``repeats`` calls of ``run``, and what the last call returned."""
    durations, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        durations.append(time.perf_counter() - start)
    return statistics.median(durations), result


def uninterrupted_seconds_per_batch(batches_per_epoch: int, batches: int) -> float:
    iterator = iter(build_loader(batches_per_epoch))
    next(iterator)  # the epoch's start-up (shuffle) is not a per-batch cost
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return (time.perf_counter() - start) / batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller epoch and fewer repeats: a smoke run")
    args = parser.parse_args()
    batches_per_epoch, repeats = (2_000, 1) if args.quick else (20_000, 3)
    batches_done = batches_per_epoch // 2
    torch.set_num_threads(1)

    epoch_start = capture_epoch_start(build_loader(batches_per_epoch))
    per_batch = uninterrupted_seconds_per_batch(batches_per_epoch, batches=min(1_000, batches_done))
    resume_seconds, resumed = timed(lambda: first_batch_by_resume(batches_per_epoch, epoch_start, batches_done), 5)
    replay_seconds, replayed = timed(lambda: first_batch_by_replay(batches_per_epoch, batches_done), repeats)
    same = all(torch.equal(a, b) for a, b in zip(resumed, replayed, strict=True))

    print(
        f"Map-style dataset of {batches_per_epoch * BATCH_SIZE:,} synthetic 3x32x32 images, shuffled, batch size "
        f"{BATCH_SIZE} ({batches_per_epoch:,} batches per epoch), num_workers=0, Fabric-wrapped, 1 thread.\n"
        f"Time from 'start resuming' to 'first batch available' at batch {batches_done:,}, median of 5 "
        f"(resume_iterator) and {repeats} (replay) runs, each on a freshly built loader.\n"
    )
    print(f"| {'method':<28} | {'seconds':>9} | {'vs resume_iterator':>18} |")
    print(f"|{'-' * 30}|{'-' * 11}|{'-' * 20}|")
    print(f"| {'resume_iterator (by index)':<28} | {resume_seconds:>9.4f} | {1.0:>17.1f}x |")
    print(f"| {'replay (fetch and drop)':<28} | {replay_seconds:>9.4f} | {replay_seconds / resume_seconds:>17.1f}x |")
    print(f"\nUninterrupted: {per_batch * 1e3:.3f} ms per batch (over {min(1_000, batches_done):,} batches).")
    print(f"Both resumes yield the same first batch: {same}.")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
