"""Hugging Face folders written and read sharded, against ``transformers``' one-process ``save_pretrained``.

What runs
---------
A random Llama (``--hidden``, ``--layers``, ``--vocab``; by default about 200 M parameters, 0.8 GB in float32) in
fresh processes, one configuration at a time:

* ``save_pretrained``: plain ``transformers`` in one process: the whole model built, ``save_pretrained(folder,
  max_shard_size=--max-file-bytes)``, then ``from_pretrained(folder)``;
* ``fabric 1`` / ``fabric N``: ``fabric.save(folder, {"model": model}, format="huggingface")`` and
  ``fabric.load(folder, {"model": model})`` on N FSDP2 ranks (gloo), the model built on the meta device and
  materialised sharded (``fabric.init_module(empty_init=True)``), so a rank never holds the whole model.

Per configuration: seconds to save and to load (the slowest rank), and each rank's peak resident memory over the save
and over the load above what it held before (``VmHWM`` after resetting it through ``/proc/self/clear_refs``), for rank
0 (which merges the ranks' pieces into each output file, one file at a time) and the largest of the others. Goal:
the memory a rank needs falls with the world size. On one machine the ranks share its cores and disk, so times
grow with the world size here; memory is what this measures.

``--bucket``: the fabric rows save to and load from a bucket of moto's S3 API on 127.0.0.1 instead (started by this
script; ``save_pretrained`` still writes a local folder): each rank uploads the weight files it owns, holding one
file's tensors at a time, so the save's peak per rank is about one file (``--max-file-bytes``), not the model.

Run ``python benchmarks/huggingface_folders.py`` (a few minutes on 2 cores) or ``--layers 2 --hidden 256`` for a
smoke check.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from job_results import print_result, run_for_result
from s3_api import s3_api

RESULT_PREFIX = "HF_FOLDER_RESULT "


def _config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 64), tie_word_embeddings=False,
    )  # fmt: skip


def _peak_above_start(action: Callable[[], Any]) -> tuple[float, float]:
    """Run ``action``; its seconds and this process's peak resident memory above its start, in GiB."""
    with open("/proc/self/clear_refs", "w") as file:  # resets VmHWM to the current resident set
        file.write("5")
    start = _status_kib("VmRSS")
    began = time.perf_counter()
    action()
    seconds = time.perf_counter() - began
    return seconds, (_status_kib("VmHWM") - start) / 2**20


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def run_transformers(args: argparse.Namespace) -> None:
    """The one-process reference: ``save_pretrained`` and ``from_pretrained``."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(args))
    folder = Path(args.folder)
    save = functools.partial(model.save_pretrained, folder, max_shard_size=args.max_file_bytes)
    save_seconds, save_peak = _peak_above_start(save)
    del model, save
    load_seconds, load_peak = _peak_above_start(lambda: LlamaForCausalLM.from_pretrained(folder))
    result = {"save_s": save_seconds, "load_s": load_seconds, "save_gib": [save_peak], "load_gib": [load_peak]}
    print_result(RESULT_PREFIX, result)


def run_fabric(args: argparse.Namespace) -> None:
    """One rank of ``fabric.save(format="huggingface")`` and ``fabric.load`` on ``--world`` FSDP2 ranks."""
    import torch
    from transformers import LlamaForCausalLM

    from fabric import Fabric

    fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=args.world)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = LlamaForCausalLM(_config(args))
    model = fabric.setup_module(model)
    folder = args.folder

    def save() -> None:
        fabric.save(folder, {"model": model}, format="huggingface", max_file_bytes=args.max_file_bytes)

    def load() -> None:
        fabric.load(folder, {"model": model})

    fabric.barrier()
    save_seconds, save_peak = _peak_above_start(save)
    fabric.barrier()
    load_seconds, load_peak = _peak_above_start(load)
    measured = torch.tensor([save_seconds, load_seconds, save_peak, load_peak], dtype=torch.float64)
    gathered = fabric.all_gather(measured)
    if fabric.is_global_zero:
        rows = gathered.reshape(-1, 4).tolist()
        result = {
            "save_s": max(row[0] for row in rows),
            "load_s": max(row[1] for row in rows),
            "save_gib": [row[2] for row in rows],
            "load_gib": [row[3] for row in rows],
        }
        print_result(RESULT_PREFIX, result)


def _measure(kind: str, world: int, args: argparse.Namespace, folder: Path | str) -> dict[str, Any] | str:
    if isinstance(folder, Path):
        shutil.rmtree(folder, ignore_errors=True)
    command = [sys.executable, __file__, "--run", kind, "--world", str(world), "--folder", str(folder)]
    command += ["--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab)]
    command += ["--max-file-bytes", str(args.max_file_bytes)]
    return run_for_result(command, RESULT_PREFIX, timeout=1800)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--max-file-bytes", type=int, default=200 * 2**20, help="largest weight file (default 200 MiB)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], help="numbers of FSDP2 ranks")
    parser.add_argument("--dir", help="where the folders go (default: a temporary directory)")
    parser.add_argument("--bucket", action="store_true", help="fabric saves to and loads from moto's S3 API")
    parser.add_argument("--run", choices=("transformers", "fabric"), help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        (run_transformers if args.run == "transformers" else run_fabric)(args)
        return

    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        parameters = sum(p.numel() for p in LlamaForCausalLM(_config(args)).parameters())
    print(
        f"# Llama {parameters / 1e6:.0f} M parameters ({parameters * 4 / 2**30:.2f} GiB float32), files of at most "
        f"{args.max_file_bytes / 2**20:.0f} MiB | torch {torch.__version__} | {os.cpu_count()} CPUs"
    )
    print("| writer | ranks | save s | load s | save peak GiB rank 0 | others | load peak GiB rank 0 | others |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    root = Path(args.dir or tempfile.mkdtemp(prefix="hf-folders-"))
    try:
        with s3_api("bench") if args.bucket else contextlib.nullcontext():
            _print_rows(args, root)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


def _print_rows(args: argparse.Namespace, root: Path) -> None:
    runs = [("transformers", 1)] + [("fabric", world) for world in args.worlds]
    for kind, world in runs:
        bucket = args.bucket and kind == "fabric"
        result = _measure(kind, world, args, f"s3://bench/{world}" if bucket else root / f"{kind}-{world}")
        name = "save_pretrained" if kind == "transformers" else f"fabric (FSDP2){', S3 API' if bucket else ''}"
        if isinstance(result, str):
            print(f"| {name} | {world} | {result} | | | | | |")
            continue
        save, load = result["save_gib"], result["load_gib"]
        others_save = f"{max(save[1:]):.2f}" if len(save) > 1 else "-"
        others_load = f"{max(load[1:]):.2f}" if len(load) > 1 else "-"
        print(
            f"| {name} | {world} | {result['save_s']:.1f} | {result['load_s']:.1f} | {save[0]:.2f} | "
            f"{others_save} | {load[0]:.2f} | {others_load} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
