"""Pipeline parallelism on torch's ``torch.distributed.pipelining``: the model cut into stages, one per rank of the
mesh's ``pipeline_parallel`` dimension, and a schedule that runs microbatches through them.

:class:`PipelinePlan` says where to cut (``split_points``, the submodules that begin stages 1, 2, ...), the loss the
last stage computes, the number of microbatches and the schedule (GPipe or 1F1B). :func:`keep_stage` cuts the model
in place, as torchtitan does: each rank keeps the modules of its own stage, so parameter names stay the model's (a
checkpoint saved on one mesh loads on any other), and the parts of other stages are removed from their containers
(``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``) or set to ``None`` elsewhere: the model's forward must skip
a ``None`` part (``h = self.embed(tokens) if self.embed is not None else tokens``).

:class:`PipelineModule` is what ``fabric.setup`` returns the forward through. A pipeline runs the forward and the
backward of every microbatch together, so the training loop reads::

    loss = model(inputs, target=targets)  # forward and backward through every stage; the loss on every rank
    fabric.backward(loss)                 # already done: accepted for the loop's sake, any other tensor refused
    optimizer.step()
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from typing_extensions import override

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

#: The schedules offered, by the names torch's papers use, and torch's class for each.
SCHEDULES = {"GPipe": "ScheduleGPipe", "1F1B": "Schedule1F1B"}
#: Containers whose forward runs the modules they still hold, so a part of another stage is removed from them.
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class PipelinePlan:
    """How the model is cut into stages and how a batch runs through them.

    Args:
        split_points: qualified names of the submodules that begin stages 1, 2, ... (one fewer than the mesh's
            ``pipeline_parallel`` degree), in the order the forward runs them, e.g. ``("blocks.2",)``.
        loss_fn: ``(output, target) -> loss`` of one microbatch, computed on the last stage; a mean over the
            microbatch's samples keeps the gradients those of the whole batch's mean loss.
        microbatches: how many equal parts each rank's batch is split into (at least the number of stages for
            1F1B); ``None``: one per stage.
        schedule: ``"1F1B"`` (one forward, one backward in the steady state: activations of at most as many
            microbatches as stages are kept) or ``"GPipe"`` (every forward, then every backward).
    """

    split_points: Sequence[str]
    loss_fn: LossFn
    microbatches: int | None = None
    schedule: str = "1F1B"

    def __post_init__(self) -> None:
        points = self.split_points
        if isinstance(points, str) or not points or not all(isinstance(point, str) and point for point in points):
            raise ValueError(
                f"PipelinePlan(split_points={points!r}) is not valid. Accepted: a sequence of submodule names, "
                "e.g. ('blocks.2',)."
            )
        object.__setattr__(self, "split_points", tuple(points))
        if len(set(points)) != len(points):
            raise ValueError(f"PipelinePlan(split_points={points!r}) names a submodule twice.")
        if not callable(self.loss_fn):
            raise ValueError(
                f"PipelinePlan(loss_fn={self.loss_fn!r}) is not valid. Accepted: (output, target) -> loss."
            )
        count = self.microbatches
        if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 1):
            raise ValueError(f"PipelinePlan(microbatches={count!r}) is not valid. Accepted: a positive int or None.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"PipelinePlan(schedule={self.schedule!r}) is not valid. Accepted: {list(SCHEDULES)}.")

    @property
    def num_stages(self) -> int:
        return len(self.split_points) + 1

    def check_degree(self, degree: int) -> None:
        """A ``ValueError`` naming both when the plan's stages are not the mesh's ``pipeline_parallel`` degree."""
        if degree != self.num_stages:
            raise ValueError(
                f"PipelinePlan(split_points={list(self.split_points)}) makes {self.num_stages} stages, but the mesh "
                f"has pipeline_parallel={degree}: give one split point fewer than the pipeline degree."
            )
        if self.schedule == "1F1B" and self.microbatches is not None and self.microbatches < degree:
            raise ValueError(
                f"PipelinePlan(microbatches={self.microbatches}, schedule='1F1B') needs at least one microbatch per "
                f"stage ({degree}); use more microbatches or schedule='GPipe'."
            )

    @property
    def microbatch_count(self) -> int:
        return self.microbatches if self.microbatches is not None else self.num_stages


def keep_stage(model: nn.Module, split_points: Sequence[str], stage_index: int) -> None:
    """Remove from ``model``, in place, every part that does not belong to stage ``stage_index``.

    The model is read as an ordered list of parts: each split point, its siblings and the siblings of its
    ancestors, in registration order (which must be the order the forward runs them). Stage ``i`` holds the parts
    from split point ``i - 1`` up to split point ``i``. A ``ValueError`` names a split point that is not a
    submodule or out of order, and a parameter that no stage can own (one held by an ancestor of a split point).
    """
    known = dict(model.named_modules())
    for point in split_points:
        if point not in known:
            tops = ", ".join(name for name, _ in model.named_children())
            raise ValueError(
                f"PipelinePlan(split_points=...): {point!r} names no submodule of {type(model).__name__} "
                f"(its top-level modules: {tops})."
            )
    ancestors = {point.rsplit(".", depth)[0] for point in split_points for depth in range(1, point.count(".") + 1)}
    ancestors.add("")
    nested = [point for point in split_points if point in ancestors]
    if nested:
        raise ValueError(f"PipelinePlan(split_points=...): {nested[0]!r} contains another split point.")
    for name in sorted(ancestors):
        own = [parameter for parameter, _ in known[name].named_parameters(recurse=False)]
        if own:
            owner = f"{type(model).__name__}{'.' + name if name else ''}"
            raise ValueError(
                f"{owner} holds the parameter {own[0]!r} itself, beside the submodules the split points cut "
                "between, so no stage can own it; move it into a submodule."
            )
    parts = _parts(model, "", ancestors)
    positions = [parts.index(point) for point in split_points]
    if positions != sorted(positions):
        raise ValueError(
            f"PipelinePlan(split_points={list(split_points)}) are not in the order the model registers its "
            "submodules (the order the forward must run them)."
        )
    for index, part in enumerate(parts):
        stage = sum(1 for position in positions if position <= index)
        if stage != stage_index:
            parent_name, _, name = part.rpartition(".")
            parent = known[parent_name]
            if isinstance(parent, CONTAINERS):
                del parent._modules[name]
            else:
                parent._modules[name] = None


def _parts(module: nn.Module, prefix: str, ancestors: set[str]) -> list[str]:
    """The qualified names of the parts (see :func:`keep_stage`) under ``module``, in registration order."""
    parts: list[str] = []
    for name, child in module._modules.items():
        qualified = f"{prefix}.{name}" if prefix else name
        if child is None:
            continue
        parts.extend(_parts(child, qualified, ancestors) if qualified in ancestors else [qualified])
    return parts


def build_schedule(
    stage_module: nn.Module,
    plan: PipelinePlan,
    stage_index: int,
    group: ProcessGroup,
    device: torch.device,
) -> PipelineScheduleSingle:
    """torch's stage for ``stage_module`` and the plan's schedule over it (shapes are inferred at the first step)."""
    from torch.distributed import pipelining

    stage = pipelining.PipelineStage(stage_module, stage_index, plan.num_stages, device, group=group)
    schedule_class = getattr(pipelining, SCHEDULES[plan.schedule])
    schedule: PipelineScheduleSingle = schedule_class(stage, n_microbatches=plan.microbatch_count, loss_fn=plan.loss_fn)
    return schedule


class PipelineModule(nn.Module):
    """One rank's stage behind the whole model's call: ``model(inputs, target=targets)`` runs the schedule.

    With gradients enabled, the forward and backward of every microbatch run together and the gradients are those
    of the mean of the microbatch losses; under ``torch.no_grad()`` only the forward runs. With a target, the mean
    loss is returned on every rank of the pipeline (sent from the last stage); without one, the last stage returns
    the model's output and the others ``None``.
    """

    def __init__(
        self,
        stage_module: nn.Module,
        schedule: PipelineScheduleSingle,
        plan: PipelinePlan,
        stage_index: int,
        group: ProcessGroup,
    ) -> None:
        super().__init__()
        self.stage_module = stage_module
        self._schedule = schedule
        self._plan = plan
        self.stage_index = stage_index
        self._group = group
        self._last_loss: weakref.ref[torch.Tensor] | None = None
        self._forward_only: PipelineScheduleSingle | None = None

    @property
    def is_first_stage(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_index == self._plan.num_stages - 1

    @override
    def forward(self, *args: Any, target: Any = None, **kwargs: Any) -> Any:
        training = torch.is_grad_enabled()
        if training and target is None:
            raise ValueError(
                "Under pipeline parallelism the training step runs the forward and the backward together, and the "
                "last stage needs the target: call model(inputs, target=targets), or run under torch.no_grad()."
            )
        self._check_batch(args, kwargs, target)
        losses: list[torch.Tensor] = []
        inputs = args if self.is_first_stage else ()
        kwargs = kwargs if self.is_first_stage else {}
        last_target = target if self.is_last_stage else None
        try:
            if target is None:
                output = self._forward_only_schedule().step(*inputs, **kwargs)
                return output if self.is_last_stage else None
            run = self._schedule.step if training else self._schedule.eval
            run(*inputs, target=last_target, losses=losses, **kwargs)
        except TypeError as error:
            if "NoneType" not in str(error):
                raise
            raise TypeError(
                f"{error} (under pipeline parallelism the parts of other stages are None on this rank, or removed "
                "from their container: a model's forward that calls one must skip a None part)"
            ) from error
        return self._loss_on_every_stage(losses)

    def _forward_only_schedule(self) -> PipelineScheduleSingle:
        """torch's forward-only schedule over the same stage, for outputs without a loss (built on first use)."""
        if self._forward_only is None:
            from torch.distributed.pipelining import _ScheduleForwardOnly  # type: ignore[attr-defined]

            self._forward_only = _ScheduleForwardOnly(self._schedule._stage, self._plan.microbatch_count)
        return self._forward_only

    def _check_batch(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any) -> None:
        count = self._plan.microbatch_count
        for value in (*args, *kwargs.values(), target):
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                if value.shape[0] % count:
                    raise ValueError(
                        f"A batch of {value.shape[0]} samples does not split into {count} equal microbatches "
                        f"(PipelinePlan(microbatches={self._plan.microbatches})): give each rank a batch size that "
                        "is a multiple of the microbatches."
                    )
                return

    def _loss_on_every_stage(self, losses: list[torch.Tensor]) -> torch.Tensor:
        import torch.distributed as dist

        if self.is_last_stage:
            loss = torch.stack([loss.detach().float() for loss in losses]).mean()
        else:
            loss = torch.empty((), dtype=torch.float32, device=self._schedule._stage.device)
        dist.broadcast(loss, group=self._group, group_src=self._plan.num_stages - 1)
        self._last_loss = weakref.ref(loss)
        return loss

    def returned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is the loss of this pipeline's latest step."""
        return self._last_loss is not None and self._last_loss() is tensor
