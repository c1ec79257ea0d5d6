"""How long a checkpoint save blocks training, and how fast it writes, against plain PyTorch and the disk.

What runs
---------
The state is a stack of ``--layers`` 4096x4096 linear layers with Adam's moments after one step
(``--layers 5``: about 1 GB of tensors), in one process on CPU. For each destination it times, best of
``--repeat`` rounds:

* ``dd``: the storage's own write speed: the same number of bytes written with ``os.write`` and
  ``fsync`` (local disk), or uploaded in one request (S3 API);
* ``torch.save``: plain PyTorch: ``torch.save`` to a file (and the same followed by ``fsync``, since a
  Fabric save is durable when it returns), or to memory then uploaded with s3fs;
* ``fabric sync``: ``fabric.save(path, state)``;
* ``fabric async``: ``fabric.save(path, state, async_save=True)``: "blocked" is until it returns
  (training goes on from there), "total" until the returned future says the checkpoint is complete.

The S3 API is moto's server on 127.0.0.1 (in memory), started by this script with s3fs as the client:
it measures the client's work and the protocol, not a real network. Columns: seconds blocked, seconds
until complete, GB/s of state, and the ratios the goals are stated in (blocked / sync total: at most
0.10; sync total / plain ``torch.save``: at most 1.2).

Run ``python benchmarks/checkpoint.py`` (about a minute: 1 GB, local disk and S3) or ``--layers 1`` for a
smoke check; ``--dir`` picks the local disk (default: a temporary directory).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from s3_api import s3_api
from torch import nn

from fabric import Fabric


def build_state(fabric: Fabric, layers: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4096, 4096) for _ in range(layers)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, optimizer = fabric.setup(model, optimizer)
    model(torch.randn(2, 4096)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer, "step": 1}


def state_bytes(state: dict[str, Any]) -> int:
    tensors = list(state["model"].state_dict().values())
    tensors += [t for entry in state["optimizer"].state_dict()["state"].values() for t in entry.values()]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def best(repeat: int, run: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    """The smallest (blocked, total) seconds over ``repeat`` rounds."""
    results = [run() for _ in range(repeat)]
    return min(r[0] for r in results), min(r[1] for r in results)


def timed(action: Callable[[], Any]) -> tuple[float, float]:
    start = time.perf_counter()
    action()
    elapsed = time.perf_counter() - start
    return elapsed, elapsed


def local_rows(
    fabric: Fabric, state: dict[str, Any], size: int, directory: Path, repeat: int
) -> list[tuple[str, float, float]]:
    raw = {"model": state["model"].module.state_dict(), "optimizer": state["optimizer"].optimizer.state_dict()}
    payload = os.urandom(1 << 24)

    def dd() -> None:
        with open(directory / "dd.bin", "wb") as file:
            for _ in range(-(-size // len(payload))):
                file.write(payload)
            file.flush()
            os.fsync(file.fileno())

    def plain(durable: bool) -> Callable[[], None]:
        def save() -> None:
            with open(directory / "plain.pt", "wb") as file:
                torch.save(raw, file)
                if durable:
                    file.flush()
                    os.fsync(file.fileno())

        return save

    def fabric_async() -> tuple[float, float]:
        start = time.perf_counter()
        written = fabric.save(directory / "async.pt", state, async_save=True)
        blocked = time.perf_counter() - start
        written.result()
        return blocked, time.perf_counter() - start

    rows = [
        ("dd (write + fsync)", *best(repeat, lambda: timed(dd))),
        ("torch.save", *best(repeat, lambda: timed(plain(False)))),
        ("torch.save + fsync", *best(repeat, lambda: timed(plain(True)))),
        ("fabric sync", *best(repeat, lambda: timed(lambda: fabric.save(directory / "sync.pt", state)))),
        ("fabric async", *best(repeat, fabric_async)),
    ]
    for name in ("dd.bin", "plain.pt", "sync.pt", "async.pt"):
        (directory / name).unlink(missing_ok=True)
    return rows


def s3_rows(fabric: Fabric, state: dict[str, Any], size: int, repeat: int) -> list[tuple[str, float, float]]:
    import fsspec

    fs = fsspec.filesystem("s3")
    raw = {"model": state["model"].module.state_dict(), "optimizer": state["optimizer"].optimizer.state_dict()}
    payload = os.urandom(size)

    def plain() -> None:
        buffer = io.BytesIO()
        torch.save(raw, buffer)
        fs.pipe_file("bench/plain.pt", buffer.getvalue())

    def fabric_async() -> tuple[float, float]:
        start = time.perf_counter()
        written = fabric.save("s3://bench/async.pt", state, async_save=True)
        blocked = time.perf_counter() - start
        written.result()
        return blocked, time.perf_counter() - start

    return [
        ("upload (one request)", *best(repeat, lambda: timed(lambda: fs.pipe_file("bench/raw.bin", payload)))),
        ("torch.save + upload", *best(repeat, lambda: timed(plain))),
        ("fabric sync", *best(repeat, lambda: timed(lambda: fabric.save("s3://bench/sync.pt", state)))),
        ("fabric async", *best(repeat, fabric_async)),
    ]


def print_table(title: str, rows: list[tuple[str, float, float]], size: int, plain_row: str) -> None:
    sync_total = next(total for name, _, total in rows if name == "fabric sync")
    plain_total = next(total for name, _, total in rows if name == plain_row)
    print(f"\n{title}: {size / 1e9:.2f} GB of state")
    print(f"{'':24} {'blocked s':>10} {'total s':>9} {'GB/s':>6} {'blocked/sync':>13} {'total/' + plain_row:>24}")
    for name, blocked, total in rows:
        print(
            f"{name:24} {blocked:10.3f} {total:9.3f} {size / 1e9 / total:6.2f} "
            f"{blocked / sync_total:13.3f} {total / plain_total:24.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=5, help="4096x4096 layers (5: about 1 GB with Adam)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="local directory to write into")
    parser.add_argument("--no-s3", action="store_true", help="local disk only")
    args = parser.parse_args()

    fabric = Fabric(accelerator="cpu", devices=1)
    state = build_state(fabric, args.layers)
    size = state_bytes(state)
    directory = args.dir or Path(tempfile.mkdtemp(prefix="fabric-checkpoint-bench-"))
    try:
        print_table(
            f"local disk ({directory})", local_rows(fabric, state, size, directory, args.repeat), size, "torch.save"
        )
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    if not args.no_s3:
        with s3_api("bench"):
            print_table(
                "S3 API (moto on 127.0.0.1)", s3_rows(fabric, state, size, args.repeat), size, "torch.save + upload"
            )


if __name__ == "__main__":
    main()
