"""2 CPU ranks: ``fabric.load_raw`` of a whole state dict in an older layout into a model sharded by FSDP2 (or by
``ModelParallelStrategy``), whose modules rename the entries as they load (litgpt's LoRA layers keep accepting
``qkv.weight`` for their ``qkv.linear.weight``). Each rank writes what it holds after the load.

Usage: ``python fsdp_renamed_load.py OUT_DIR fsdp|model_parallel``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from fabric import Fabric
from fabric.strategies import FSDPStrategy, ModelParallelStrategy


class Renaming(nn.Module):
    """A linear layer behind a wrapper that still loads the entries of the plain layer (``weight``, ``bias``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.linear(inputs)  # type: ignore[no-any-return]

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        for name in ("weight", "bias"):
            if prefix + name in state_dict:
                state_dict[prefix + "linear." + name] = state_dict.pop(prefix + name)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _shard_as_litgpt_does(model: nn.Module, mesh: Any) -> nn.Module:
    """litgpt's ``parallelize_fn`` for ``ModelParallelStrategy``: FSDP2 over the data-parallel dimension."""
    for layer in model:
        if isinstance(layer, Renaming):
            fully_shard(layer, mesh=mesh["data_parallel"])
    return fully_shard(model, mesh=mesh["data_parallel"])


def main(out_dir: Path, kind: str) -> None:
    strategy = (
        FSDPStrategy()
        if kind == "fsdp"
        else ModelParallelStrategy(_shard_as_litgpt_does, data_parallel_size=2, tensor_parallel_size=1)
    )
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup(nn.Sequential(Renaming(), nn.ReLU(), Renaming()))
    old_layout = {
        "0.weight": torch.arange(64.0).reshape(8, 8), "0.bias": torch.arange(8.0),
        "2.weight": -torch.arange(64.0).reshape(8, 8), "2.bias": -torch.arange(8.0),
    }  # fmt: skip
    path = out_dir / "old-layout.pt"
    if fabric.global_rank == 0:
        torch.save(old_layout, path)
    fabric.barrier()
    fabric.load_raw(path, model, strict=False)  # as litgpt loads its base weights into a LoRA model
    held = {name: parameter.to_local().numel() for name, parameter in model.named_parameters()}
    whole = {name: parameter.full_tensor().tolist() for name, parameter in model.named_parameters()}
    report = {"held": held, "whole": whole}
    (out_dir / f"{kind}-rank{fabric.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
