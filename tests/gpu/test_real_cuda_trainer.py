"""The Trainer on a real CUDA GPU: ``device_train_microbatch_size="auto"`` recovering from real CUDA
out-of-memory errors. Skipped where there is no CUDA GPU (``tests/conftest.py``)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric.trainer.trainer import Trainer

pytestmark = pytest.mark.cuda

BATCH_SIZE = 16
#: A sample's activation is 1/SHARE of the GPU's free memory: 16 and 8 samples cannot fit, 4 (2/3 of it) can.
SHARE = 6
ROW = 1 << 20  # float32 elements per row of the activation (4 MiB)

Batch = tuple[torch.Tensor, torch.Tensor]


class WideActivation(nn.Module):
    """A linear regressor whose forward first materialises a ``(samples, rows, ROW)`` float32 activation, so its
    memory grows with the microbatch; it records the size of every microbatch it was asked to run."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows
        self.net = nn.Linear(8, 1)
        self.sizes: list[int] = []

    def forward(self, batch: Batch) -> torch.Tensor:
        x = batch[0]
        self.sizes.append(len(x))
        wide = x[:, :1, None].expand(-1, self.rows, ROW).contiguous()  # samples x rows x 4 MiB, really allocated
        first = wide[:, -1, -1:]  # equal to x[:, :1]
        output: torch.Tensor = self.net(torch.cat([first, x[:, 1:]], dim=1))
        return output

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        return F.mse_loss(outputs, batch[1])


def _fit(model: WideActivation, microbatch_size: int | str) -> Trainer:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2 * BATCH_SIZE, 8, generator=generator)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    options: dict[str, Any] = {
        "train_dataloader": DataLoader(data, batch_size=BATCH_SIZE),
        "max_duration": "2ba",
        "optimizers": torch.optim.SGD(model.parameters(), lr=0.1),
        "device_train_microbatch_size": microbatch_size,
        "accelerator": "cuda",
        "devices": 1,
        "progress_bar": False,
        "seed": 0,
    }
    trainer = Trainer(model=model, **options)
    trainer.fit()
    return trainer


def test_auto_microbatching_recovers_from_real_cuda_out_of_memory_and_trains_like_a_size_that_fits() -> None:
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    rows = max(1, free // SHARE // (4 * ROW))
    torch.manual_seed(0)
    auto_model = WideActivation(rows)
    fixed_model = copy.deepcopy(auto_model)
    initial = [parameter.detach().clone() for parameter in auto_model.parameters()]

    auto = _fit(auto_model, "auto")
    assert auto_model.sizes[:2] == [16, 8], f"expected two real OOMs first; ran {auto_model.sizes}"
    assert auto_model.sizes[2:] == [4] * 8, f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free; {auto_model.sizes}"
    assert auto.state.device_train_microbatch_size == 4
    auto_loss = float(auto.state.loss)
    auto.close()

    fixed = _fit(fixed_model, 4)  # the size auto found, from the start: no OOM
    assert fixed_model.sizes == [4] * 8
    assert auto_loss == pytest.approx(float(fixed.state.loss), rel=1e-6, abs=1e-7)
    for ours, theirs, before in zip(auto_model.parameters(), fixed_model.parameters(), initial, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
        assert not torch.equal(ours.detach().cpu(), before), "training left a parameter unchanged"
    fixed.close()
