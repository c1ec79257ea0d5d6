"""The Trainer on pipeline stages (``ModelParallelStrategy(pipeline=PipelinePlan(...))`` or
``parallelism_config={"pp": {...}}``): the model's ``forward(batch)`` and ``loss(outputs, batch)`` as the pipeline's
stages and loss.

The split points lie inside one submodule of the model, its *network* (``PipelinePlan(network=...)``, else the first
name every split point shares, e.g. ``"model"`` for ``"model.blocks.2"``). The first stage runs the model's
``forward(batch)`` on each microbatch, which must call the network and return its output as it is; the later stages
run the network on the activations they receive; the last stage computes ``model.loss(outputs, microbatch)``. To give
the loss its microbatch, the pipeline's target is the batch's sample indices (torch splits it as it splits the
batch), which :class:`PipelineLoss` turns back into the slice of the batch.

The forward, loss and backward of every microbatch run in one call, so the events between BEFORE_FORWARD and
AFTER_BACKWARD fire once per batch, around it: the batch as BEFORE_FORWARD left it is what trains, and a change of
``state.batch``, ``state.outputs`` or ``state.loss`` at a later event (which could no longer change what trained) is
refused. ``state.outputs`` holds the last stage's outputs (None on the other stages); train and eval metrics are
updated there and summed over every rank as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from fabric.trainer.microbatch import joined_outputs

if TYPE_CHECKING:
    from fabric.strategies.pipeline import PipelinePlan
    from fabric.strategies.strategy import Strategy

#: What a pipeline step cannot do under the Trainer, by the setting that asks for it, and what to do instead.
REFUSALS = {
    "device_train_microbatch_size": "the pipeline splits each batch into PipelinePlan(microbatches=...) itself; "
    "leave device_train_microbatch_size out",
    "grad_accum": "the pipeline splits each batch into PipelinePlan(microbatches=...) itself; leave grad_accum out",
    "accumulate_train_batch_on_tokens": "the pipeline averages its equal microbatches' losses; weight by tokens "
    "inside model.loss instead",
}


def pipeline_network(plan: PipelinePlan, model: nn.Module) -> str:
    """The network the plan cuts: ``plan.network``, else the first name every split point shares. Refused: split
    points that cut the model itself (its ``forward(batch)`` cannot run on activations) and a plan's own loss."""
    if plan.loss_fn is not None and not isinstance(plan.loss_fn, PipelineLoss):
        raise ValueError(
            f"PipelinePlan(loss_fn={plan.loss_fn!r}) under the Trainer: the loss is the model's loss(outputs, batch); "
            "leave loss_fn out."
        )
    if plan.network:
        return plan.network
    firsts = {point.split(".", 1)[0] for point in plan.split_points}
    network = firsts.pop() if len(firsts) == 1 and all("." in point for point in plan.split_points) else None
    children = dict(model.named_children())
    if network is None or isinstance(children.get(network), (nn.ModuleList, nn.ModuleDict, type(None))):
        raise ValueError(
            f"PipelinePlan(split_points={list(plan.split_points)}) cuts {type(model).__name__} itself, but under "
            "the Trainer its forward(batch) runs on the first stage only: the split points must lie inside one "
            f"submodule it calls (its network, one of {sorted(children)}, e.g. 'model.blocks.2'), which the later "
            "stages run on the activations; or name it with PipelinePlan(network=...)."
        )
    return network


def check_pipeline_settings(strategy: Strategy, settings: Mapping[str, object]) -> None:
    """A ``ValueError`` naming the first of ``settings`` (by name, truthy when asked for) a pipeline cannot honour."""
    if strategy.pipeline is None:
        return
    for name, value in settings.items():
        if value:
            raise ValueError(f"{name}={value!r} cannot be honoured under pipeline parallelism: {REFUSALS[name]}.")


class PipelineLoss:
    """The pipeline's loss from the model's: ``model.loss(outputs, microbatch)``, the microbatch being the slice of
    the current batch that the sample indices in the target name. Keeps each microbatch with its (detached) outputs
    for the metrics."""

    def __init__(self, loss: Callable[[Any, Any], torch.Tensor]) -> None:
        self._loss = loss
        self.batch: Any = None
        #: ``(microbatch, outputs)`` of the latest step, on the last stage.
        self.microbatches: list[tuple[Any, Any]] = []

    def plan(self, plan: PipelinePlan, model: nn.Module) -> PipelinePlan:
        """``plan`` with this loss and the network the Trainer's model cuts."""
        return replace(plan, loss_fn=self, network=pipeline_network(plan, model))

    def start(self, batch: Any) -> torch.Tensor:
        """Take ``batch`` for the next step; returns the target to give the pipeline (its sample indices)."""
        leaves = [leaf for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
        if not leaves:
            raise TypeError(
                f"Under pipeline parallelism the batch must hold its tensors in tuples, lists or dicts, which "
                f"torch's pipelining splits into microbatches; got a {type(batch).__name__} holding none it can split."
            )
        self.batch = batch
        self.microbatches = []
        return torch.arange(leaves[0].shape[0])

    def outputs(self) -> Any:
        """The latest step's outputs, every microbatch's joined, on the last stage; None on the others."""
        return joined_outputs([outputs for _, outputs in self.microbatches]) if self.microbatches else None

    def __call__(self, outputs: Any, indices: torch.Tensor) -> torch.Tensor:
        start, stop = int(indices[0]), int(indices[-1]) + 1
        microbatch = tree_map(lambda leaf: _rows(leaf, start, stop), self.batch)
        self.microbatches.append((microbatch, tree_map(_detached, outputs)))
        return self._loss(outputs, microbatch)


def _rows(leaf: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of a batch's tensor (as torch's pipelining splits it); other leaves whole."""
    return leaf[start:stop] if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else leaf


def _detached(leaf: Any) -> Any:
    return leaf.detach() if isinstance(leaf, torch.Tensor) else leaf
