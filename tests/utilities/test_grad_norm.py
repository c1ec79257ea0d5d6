"""``clip_grad_norm_`` over DTensors on different meshes (tensor-parallel layers beside FSDP-only ones): torch's own
cannot stack their norms; this one clips by the same total norm a single tensor list would have."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

from fabric.utilities.grad_norm import clip_grad_norm_


@pytest.mark.usefixtures("group_of_one")
def test_parameters_on_two_meshes_are_clipped_by_their_total_norm() -> None:
    first, second = (
        init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)),
        init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)),
    )
    plain = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    plain[0].grad, plain[1].grad = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 4.0])
    sharded = [
        torch.nn.Parameter(distribute_tensor(torch.zeros(3), first, [Replicate()])),
        torch.nn.Parameter(distribute_tensor(torch.zeros(2), second, [Replicate()])),
    ]
    for parameter, reference in zip(sharded, plain, strict=True):
        parameter.grad = distribute_tensor(reference.grad.clone(), parameter.device_mesh, [Replicate()])
    with pytest.raises(RuntimeError, match="same mesh"):
        torch.nn.utils.clip_grad_norm_(sharded, max_norm=1.0)
    total = clip_grad_norm_(sharded, max_norm=1.0)
    expected = torch.nn.utils.clip_grad_norm_(plain, max_norm=1.0)
    assert total.item() == pytest.approx(expected.item()) == pytest.approx(5.0)
    for parameter, reference in zip(sharded, plain, strict=True):
        torch.testing.assert_close(parameter.grad.full_tensor(), reference.grad)
