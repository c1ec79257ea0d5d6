"""Pipeline parallelism on torch's ``torch.distributed.pipelining``: the model cut into stages, one or several per
rank of the mesh's ``pipeline_parallel`` dimension, and a schedule that runs microbatches through them.

:class:`PipelinePlan` says where to cut (``split_points``, the submodules that begin stages 1, 2, ...), the loss the
last stage computes, the number of microbatches and the schedule: GPipe or 1F1B with one stage per rank;
Interleaved1F1B, LoopedBFS or InterleavedZeroBubble with several (rank ``r`` of ``P`` holds stages ``r``, ``r + P``,
...: more stages than ranks fill the pipeline's bubble less); ZBVZeroBubble or DualPipeV with two in a V (stages ``r``
and ``2P - 1 - r``). The zero-bubble ones compute the weights' gradients apart from the input's, later.
:func:`keep_stages` cuts the model in place by the stage of each part
(:func:`stage_parts`), as torchtitan does: each rank keeps the modules of its own stages, so parameter names stay the
model's (a checkpoint saved on one mesh loads on any other), and the parts of other stages are removed from their
containers (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``) or set to ``None`` elsewhere: the model's forward
must skip a ``None`` part (``h = self.embed(tokens) if self.embed is not None else tokens``). A rank with several stages
runs each through a :func:`stage_view` of the model: its own containers down to the parts, the parts themselves shared.
With ``network=`` only that submodule is cut: the first stage runs the model's own forward (which turns the batch into
the network's input and calls it), every later stage runs the network on the activations it receives (what the Trainer
does with a model's ``forward(batch)``).

:class:`PipelineModule` is what ``fabric.setup`` returns the forward through. A pipeline runs the forward and the
backward of every microbatch together, so the training loop reads::

    loss = model(inputs, target=targets)  # forward and backward through every stage; the loss on every rank
    fabric.backward(loss)                 # already done: accepted for the loop's sake, any other tensor refused
    optimizer.step()
"""

from __future__ import annotations

import copy
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from typing_extensions import override

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.pipelining.schedules import _PipelineSchedule

#: The schedules offered, by the names torch's papers use, and torch's class for each.
SCHEDULES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "LoopedBFS": "ScheduleLoopedBFS",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
    "DualPipeV": "ScheduleDualPipeV",
}
#: The schedules that run several stages on each rank (the others run exactly one).
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
#: The schedules that place exactly two stages on each rank in a V: rank ``r`` of ``P`` holds stages ``r`` and
#: ``2P - 1 - r`` (the first rank holds the first and the last stage).
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
#: The schedules that split each backward into the input's gradient (sent on at once) and the weights' (run later, in
#: the bubble): FSDP must keep a stage's parameters gathered from its forward until then.
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
#: The others: one backward through each stage (what FSDP resharding after the forward and checkpointing need).
WHOLE_BACKWARD_SCHEDULES = tuple(name for name in SCHEDULES if name not in SPLIT_BACKWARD_SCHEDULES)
#: Containers whose forward runs the modules they still hold, so a part of another stage is removed from them.
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)

#: How many schedules (one per shape of the batch's tensors: torch's stages keep the shapes of their first step)
#: a pipeline keeps; a ragged last batch or another sequence length adds one.
SCHEDULES_KEPT = 8

LossFn = Callable[[Any, Any], torch.Tensor]

#: The stage of a part kept on every stage (:attr:`PipelinePlan.every_stage`).
EVERY_STAGE = -1

#: What a stage view shares with the model in each container it copies: its tensors (a buffer materialised or moved
#: through one is the model's; the containers of the parts hold no parameter of their own).
SHARED_WITH_VIEWS = ("_parameters", "_buffers", "_non_persistent_buffers_set")


@dataclass(frozen=True)
class PipelinePlan:
    """How the model is cut into stages and how a batch runs through them.

    Args:
        split_points: qualified names of the submodules that begin stages 1, 2, ..., in the order the forward runs
            them, e.g. ``("blocks.2",)``: one fewer than the mesh's ``pipeline_parallel`` degree, or with a
            multi-stage schedule one fewer than a multiple of it (that many stages per rank).
        loss_fn: ``(output, target) -> loss`` of one microbatch, computed on the last stage; a mean over the
            microbatch's samples keeps the gradients those of the whole batch's mean loss. ``None`` only under the
            Trainer, which computes it with its model's ``loss(outputs, batch)``.
        microbatches: how many equal parts each rank's batch is split into (at least the number of stages for
            1F1B; a multiple of ``microbatches // pipeline_parallel`` for Interleaved1F1B); ``None``: one per stage.
        schedule: ``"1F1B"`` (one forward, one backward in the steady state: activations of at most as many
            microbatches as stages are kept), ``"GPipe"`` (every forward, then every backward), both with one stage
            per rank; ``"Interleaved1F1B"`` (1F1B over several stages per rank, a smaller bubble),
            ``"LoopedBFS"`` (each rank's earlier stage first, breadth-first) or ``"InterleavedZeroBubble"`` (the
            weights' backward apart, filling the bubble), with one or more; ``"ZBVZeroBubble"`` or ``"DualPipeV"``
            (zero bubble with two stages per rank in a V; DualPipeV with at least one microbatch per stage).
        network: the submodule that is cut into stages, e.g. ``"model"`` (every split point lies inside it, and
            every parameter of the model too); the first stage runs the model's own forward, which must call the
            network and return its output as it is, and the later stages run the network on what they receive.
            ``""`` (default): the whole model, whose forward runs on every stage.
        stage_forward: ``(module, *inputs) -> output``, run on every stage in place of the forward of the module
            that is cut (the network, or the model), for one whose own forward cannot skip the parts another stage
            holds (a Hugging Face model's): ``module`` holds this stage's parts only (the others ``None`` or removed
            from their container), ``inputs`` are the batch's on the first stage and the activations after.
        every_stage: parts kept on every stage (e.g. ``("model.rotary_emb",)``, which each stage's layers need):
            modules without parameters, since each parameter belongs to one stage.
    """

    split_points: Sequence[str]
    loss_fn: LossFn | None = None
    microbatches: int | None = None
    schedule: str = "1F1B"
    network: str = ""
    stage_forward: Callable[..., Any] | None = None
    every_stage: Sequence[str] = ()

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
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise ValueError(
                f"PipelinePlan(loss_fn={self.loss_fn!r}) is not valid. Accepted: (output, target) -> loss."
            )
        outside = [point for point in points if self.network and not point.startswith(f"{self.network}.")]
        if not isinstance(self.network, str) or outside:
            raise ValueError(
                f"PipelinePlan(network={self.network!r}) is not valid with split_points={list(points)}. Accepted: "
                "the name of the submodule every split point lies in (e.g. 'model' for 'model.blocks.2'), or ''."
            )
        if self.stage_forward is not None and not callable(self.stage_forward):
            raise ValueError(
                f"PipelinePlan(stage_forward={self.stage_forward!r}) is not valid. Accepted: (module, *inputs) -> "
                "output, or None."
            )
        kept = self.every_stage
        if isinstance(kept, str) or not all(isinstance(name, str) and name for name in kept):
            raise ValueError(
                f"PipelinePlan(every_stage={kept!r}) is not valid. Accepted: a sequence of submodule names, e.g. "
                "('model.rotary_emb',)."
            )
        object.__setattr__(self, "every_stage", tuple(kept))
        count = self.microbatches
        if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 1):
            raise ValueError(f"PipelinePlan(microbatches={count!r}) is not valid. Accepted: a positive int or None.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"PipelinePlan(schedule={self.schedule!r}) is not valid. Accepted: {list(SCHEDULES)}.")

    @property
    def num_stages(self) -> int:
        return len(self.split_points) + 1

    def check_degree(self, degree: int) -> None:
        """A ``ValueError`` naming both when the plan's stages cannot be placed on the mesh's ``pipeline_parallel``
        ranks, or its microbatches cannot run on its schedule there."""
        multi_stage = self.schedule in MULTI_STAGE_SCHEDULES
        if self.schedule in V_SCHEDULES:
            fits, accepted = self.num_stages == 2 * degree, f"{2 * degree - 1} split points (two stages per rank)"
        elif multi_stage:
            fits, accepted = self.num_stages % degree == 0, "a multiple of the pipeline degree, minus one"
        else:
            fits = self.num_stages == degree
            accepted = (
                f"one split point fewer than the pipeline degree, or several stages per rank with a schedule of "
                f"{list(MULTI_STAGE_SCHEDULES)}"
            )
        if not fits:
            raise ValueError(
                f"PipelinePlan(split_points={list(self.split_points)}, schedule={self.schedule!r}) makes "
                f"{self.num_stages} stages, but the mesh has pipeline_parallel={degree}: give {accepted}."
            )
        count = self.microbatch_count
        least = {"1F1B": degree, "DualPipeV": self.num_stages}.get(self.schedule, 1)
        if count < least:
            raise ValueError(
                f"PipelinePlan(microbatches={self.microbatches}, schedule={self.schedule!r}) needs at least one "
                f"microbatch per stage ({least}); use more microbatches"
                f"{' or schedule=' + repr('GPipe') if self.schedule == '1F1B' else ''}."
            )
        rounds = max(1, count // degree)
        if self.schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and count % rounds != 0:
            raise ValueError(
                f"PipelinePlan(microbatches={count}, schedule={self.schedule!r}) on pipeline_parallel={degree}: the "
                f"schedule runs them in rounds of {degree}, so give a multiple of {rounds} (or fewer than {degree})."
            )

    def stages_of(self, rank: int, degree: int) -> tuple[int, ...]:
        """The stages pipeline rank ``rank`` of ``degree`` holds, in order: ``rank``, ``rank + degree``, ... (torch's
        loop placement, which its multi-stage schedules expect), or ``rank`` and ``2 * degree - 1 - rank`` under a
        V-shaped schedule."""
        if self.schedule in V_SCHEDULES:
            return (rank, 2 * degree - 1 - rank)
        return tuple(range(rank, self.num_stages, degree))

    def rank_of(self, stage: int, degree: int) -> int:
        """The pipeline rank that holds ``stage`` (the inverse of :meth:`stages_of`)."""
        if self.schedule in V_SCHEDULES and stage >= degree:
            return 2 * degree - 1 - stage
        return stage % degree

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule computes the weights' gradients apart from, and after, the input's."""
        return self.schedule in SPLIT_BACKWARD_SCHEDULES

    @property
    def default_degree(self) -> int:
        """The ``pipeline_parallel`` degree when none is given: one stage per rank, or two in a V."""
        return self.num_stages // 2 if self.schedule in V_SCHEDULES else self.num_stages

    @property
    def microbatch_count(self) -> int:
        return self.microbatches if self.microbatches is not None else self.num_stages


def stage_parts(
    model: nn.Module, split_points: Sequence[str], network: str = "", every_stage: Sequence[str] = ()
) -> dict[str, int]:
    """The stage of each part of ``model``, by the part's qualified name (:data:`EVERY_STAGE` for those of
    ``every_stage``).

    The model (or its submodule ``network``, when named: the rest of the model stays on every stage and may hold
    no parameter) is read as an ordered list of parts: each split point, its siblings and the siblings of its
    ancestors, in registration order (which must be the order the forward runs them). Stage ``i`` holds the parts
    from split point ``i - 1`` up to split point ``i``. A ``ValueError`` names a split point that is not a
    submodule or out of order, and a parameter that no stage can own (one held by an ancestor of a split point).
    """
    if network:
        cut = _network_of(model, network)
        inside = [name[len(network) + 1 :] if name.startswith(f"{network}.") else name for name in every_stage]
        inner = stage_parts(cut, [point[len(network) + 1 :] for point in split_points], every_stage=inside)
        return {f"{network}.{part}": stage for part, stage in inner.items()}
    known = dict(model.named_modules())
    ancestors = _ancestors(split_points)
    for point in split_points:
        if point not in known:
            tops = ", ".join(name for name, _ in model.named_children())
            raise ValueError(
                f"PipelinePlan(split_points=...): {point!r} names no submodule of {type(model).__name__} "
                f"(its top-level modules: {tops})."
            )
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
    stages = {part: sum(1 for position in positions if position <= index) for index, part in enumerate(parts)}
    for name in every_stage:
        if name not in stages:
            raise ValueError(
                f"PipelinePlan(every_stage=...): {name!r} is not one of the parts the split points cut the model "
                f"into (they are: {', '.join(stages)})."
            )
        held = next((parameter for parameter, _ in known[name].named_parameters()), None)
        if held is not None:
            raise ValueError(
                f"PipelinePlan(every_stage=...): {name!r} holds the parameter {held!r}, which belongs to one stage; "
                "only modules without parameters are kept on every stage."
            )
        stages[name] = EVERY_STAGE
    return stages


def keep_stages(model: nn.Module, parts: Mapping[str, int], stages: Collection[int]) -> None:
    """Remove from ``model``, in place, every part (of :func:`stage_parts`) that belongs to none of ``stages``: from
    its container, or set to ``None`` in any other parent."""
    known = dict(model.named_modules())
    for part, stage in parts.items():
        parent_name, _, name = part.rpartition(".")
        parent = known.get(parent_name)
        kept = stage in stages or stage == EVERY_STAGE
        if kept or parent is None or parent._modules.get(name) is None:  # kept, or already removed
            continue
        if isinstance(parent, CONTAINERS):
            del parent._modules[name]
        else:
            parent._modules[name] = None


def stage_view(model: nn.Module, parts: Mapping[str, int], stage: int) -> nn.Module:
    """A module that runs ``stage`` alone of a model cut with :func:`keep_stages` to several stages: a copy of
    ``model`` and of each container between it and the parts (pruned to ``stage``'s), the parts themselves shared
    with ``model``, so the view's parameters are the model's under the model's names."""
    view = _copy_containers(model, "", _ancestors(parts))
    keep_stages(view, parts, (stage,))
    return view


def _copy_containers(module: nn.Module, prefix: str, ancestors: set[str]) -> nn.Module:
    """``module`` copied with its descendants among ``ancestors``; every other child is shared."""
    view = copy.copy(module)
    for name, value in vars(module).items():  # its own children and hooks: sharding one view touches no other
        if isinstance(value, (dict, set)) and name not in SHARED_WITH_VIEWS:
            setattr(view, name, copy.copy(value))
    for name, child in module._modules.items():
        qualified = f"{prefix}.{name}" if prefix else name
        if child is not None and qualified in ancestors:
            view._modules[name] = _copy_containers(child, qualified, ancestors)
    return view


def _ancestors(names: Collection[str]) -> set[str]:
    """The qualified names of the modules that contain one of ``names`` (``""``: the model)."""
    ancestors = {name.rsplit(".", depth)[0] for name in names for depth in range(1, name.count(".") + 1)}
    ancestors.add("")
    return ancestors


def _network_of(model: nn.Module, network: str) -> nn.Module:
    """The submodule ``network`` of ``model``, refused unless it holds every parameter of the model."""
    try:
        cut = model.get_submodule(network)
    except AttributeError:
        tops = ", ".join(name for name, _ in model.named_children())
        raise ValueError(
            f"PipelinePlan(network={network!r}) names no submodule of {type(model).__name__} (its top-level "
            f"modules: {tops})."
        ) from None
    outside = [name for name, _ in model.named_parameters() if not name.startswith(f"{network}.")]
    if outside:
        raise ValueError(
            f"{type(model).__name__} holds the parameter {outside[0]!r} outside its network {network!r}, which is "
            "what the pipeline cuts into stages, so no stage can own it; move it into the network."
        )
    return cut


def _parts(module: nn.Module, prefix: str, ancestors: set[str]) -> list[str]:
    """The qualified names of the parts (see :func:`keep_stage`) under ``module``, in registration order."""
    parts: list[str] = []
    for name, child in module._modules.items():
        qualified = f"{prefix}.{name}" if prefix else name
        if child is None:
            continue
        parts.extend(_parts(child, qualified, ancestors) if qualified in ancestors else [qualified])
    return parts


class StageForward:
    """This rank's stage's forward, put on the stage module itself (so the hooks of its call, FSDP's among them,
    still run).

    torch's stages take tensors only, so the first stage is given the tensors of the call's inputs and rebuilds
    the inputs' structure around them (:meth:`flatten` keeps it: tuples, lists, dicts, other leaves as they are)
    before running the model's forward. With ``network`` the first stage's forward must call that submodule once and
    return its output as it is, and the later stages run the network on the activations they receive.
    """

    def __init__(
        self, root: nn.Module, network: str, stage_index: int, stage_forward: Callable[..., Any] | None = None
    ) -> None:
        self._root, self._network = root, network
        self._cut = root.get_submodule(network) if network else None
        self._own_forward = stage_forward if stage_forward is not None and not network else type(root).forward
        self._structure: tuple[Any, list[Any], list[bool]] | None = None
        if stage_forward is not None:  # a method, not a module: setattr would register that as a child
            cut = root if self._cut is None else self._cut
            cut.forward = types.MethodType(stage_forward, cut)
        if stage_index == 0:
            root.forward = self.first_stage
        elif self._cut is not None:
            root.forward = self.later_stage

    def later_stage(self, *activations: torch.Tensor) -> Any:
        assert self._cut is not None
        return self._cut(*activations)

    def flatten(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        """The tensors of ``(args, kwargs)`` that split into microbatches (at least one dimension), in order."""
        from torch.utils._pytree import tree_flatten

        leaves, spec = tree_flatten((args, kwargs))
        splits = [isinstance(leaf, torch.Tensor) and leaf.dim() > 0 for leaf in leaves]
        self._structure = spec, leaves, splits
        return tuple(leaf for leaf, split in zip(leaves, splits, strict=True) if split)

    def first_stage(self, *tensors: torch.Tensor) -> Any:
        from torch.utils._pytree import tree_unflatten

        assert self._structure is not None, "flatten() gives the first stage its inputs"
        spec, leaves, splits = self._structure
        given = iter(tensors)
        args, kwargs = tree_unflatten(
            [next(given) if split else leaf for leaf, split in zip(leaves, splits, strict=True)], spec
        )
        if self._cut is None:
            return self._own_forward(self._root, *args, **kwargs)
        seen: list[Any] = []
        handle = self._cut.register_forward_hook(lambda _module, _inputs, output: seen.append(output))
        try:
            output = self._own_forward(self._root, *args, **kwargs)
        finally:
            handle.remove()
        if len(seen) != 1 or output is not seen[0]:
            raise ValueError(
                f"PipelinePlan(network={self._network!r}): {type(self._root).__name__}.forward must call its network "
                f"once and return its output as it is (it called it {len(seen)} time(s) and returned "
                f"{'something else' if seen else type(output).__name__}): the first stage sends that output to the "
                "next, and the last stage's network output is the model's output."
            )
        return output


class PipelineModule(nn.Module):
    """One rank's stages behind the whole model's call: ``model(inputs, target=targets)`` runs the schedule.

    ``module`` is this rank's cut of the model (its parameters under the model's names); ``stage_modules`` run its
    stages (``module`` itself when it holds one, else a :func:`stage_view` each). With gradients enabled, the forward
    and backward of every microbatch run together and the gradients are those of the mean of the microbatch losses;
    under ``torch.no_grad()`` only the forward runs. With a target, the mean loss is returned on every rank of the
    pipeline (sent from the last stage); without one, the rank of the last stage returns the model's output and the
    others ``None``. torch's stages keep the shapes of their first step, so each shape of the batch's tensors (a
    ragged last batch, another sequence length) gets a schedule of its own, built in step on every rank of the
    pipeline (they read the same batches).
    """

    def __init__(
        self,
        module: nn.Module,
        stage_modules: Sequence[nn.Module],
        plan: PipelinePlan,
        stage_indices: Sequence[int],
        group: ProcessGroup,
        device: torch.device,
    ) -> None:
        super().__init__()
        if plan.loss_fn is None:
            raise ValueError(
                "PipelinePlan(loss_fn=None): the last stage needs the loss of a microbatch; give "
                "loss_fn=(output, target) -> loss (only the Trainer supplies it, from its model's loss)."
            )
        self._stage_forwards = [
            StageForward(stage, plan.network, index, plan.stage_forward)
            for stage, index in zip(stage_modules, stage_indices, strict=True)
        ]
        self.stage_module = module
        self._stage_modules = tuple(stage_modules)  # not children: their parts are the module's, registered once
        self._plan = plan
        self._loss_fn: LossFn = plan.loss_fn
        self.stage_indices = tuple(stage_indices)
        self._group = group
        self._device = device
        self._last_loss: weakref.ref[torch.Tensor] | None = None
        self._schedules: OrderedDict[tuple[Any, ...], _PipelineSchedule] = OrderedDict()

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank holds the first stage (it is given the inputs)."""
        return 0 in self.stage_indices

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the last stage (it computes the loss and the output)."""
        return self._plan.num_stages - 1 in self.stage_indices

    @override
    def train(self, mode: bool = True) -> PipelineModule:
        super().train(mode)
        for stage in self._stage_modules:  # a view's own containers are copies: their mode follows the module's
            stage.train(mode)
        return self

    @override
    def forward(self, *args: Any, target: Any = None, **kwargs: Any) -> Any:
        training = torch.is_grad_enabled()
        if training and target is None:
            raise ValueError(
                "Under pipeline parallelism the training step runs the forward and the backward together, and the "
                "last stage needs the target: call model(inputs, target=targets), or run under torch.no_grad()."
            )
        microbatches = self._microbatches(args, kwargs, target, training)
        losses: list[torch.Tensor] = []
        inputs = self._stage_forwards[0].flatten(args, kwargs) if self.is_first_stage else ()
        last_target = target if self.is_last_stage else None
        try:
            if target is None:
                output = self._schedule(args, kwargs, target, microbatches, "forward").step(*inputs)
                return output if self.is_last_stage else None
            schedule = self._schedule(args, kwargs, target, microbatches, "train" if training else "eval")
            run = schedule.step if training else schedule.eval
            run(*inputs, target=last_target, losses=losses)
        except TypeError as error:
            if "NoneType" not in str(error):
                raise
            raise TypeError(
                f"{error} (under pipeline parallelism the parts of other stages are None on this rank, or removed "
                "from their container: a model's forward that calls one must skip a None part)"
            ) from error
        return self._loss_on_every_stage(losses)

    def _schedule(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, microbatches: int, kind: str
    ) -> _PipelineSchedule:
        """The schedule for batches of these shapes (built on first use, the least recently used dropped beyond
        :data:`SCHEDULES_KEPT`)."""
        from torch.utils._pytree import tree_leaves

        leaves = tree_leaves((args, kwargs, target))
        key = (
            kind,
            microbatches,
            *((tuple(leaf.shape), leaf.dtype) for leaf in leaves if isinstance(leaf, torch.Tensor)),
        )
        schedule = self._schedules.get(key)
        if schedule is None:
            schedule = self._schedules[key] = self._build(microbatches, kind)
            if len(self._schedules) > SCHEDULES_KEPT:
                self._schedules.popitem(last=False)
        else:
            self._schedules.move_to_end(key)
        return schedule

    def _build(self, microbatches: int, kind: str) -> _PipelineSchedule:
        """torch's stages over this rank's modules and a schedule over them (shapes are inferred at its first
        step) for ``kind`` of step: ``"train"``, ``"eval"`` (forwards and the loss) or ``"forward"`` (forwards
        alone: a multi-stage schedule without a loss)."""
        forward_only = kind == "forward"
        from torch.distributed import pipelining

        stages = [
            pipelining.PipelineStage(module, index, self._plan.num_stages, self._device, group=self._group)
            for module, index in zip(self._stage_modules, self.stage_indices, strict=True)
        ]
        multi_stage = self._plan.schedule in MULTI_STAGE_SCHEDULES
        schedule_class = getattr(pipelining, SCHEDULES[self._plan.schedule])
        if forward_only and not multi_stage:
            from torch.distributed.pipelining import _ScheduleForwardOnly  # type: ignore[attr-defined]

            forward_schedule: _PipelineSchedule = _ScheduleForwardOnly(stages[0], microbatches)
            return forward_schedule
        loss_fn = None if forward_only else self._loss_fn
        schedule: _PipelineSchedule = schedule_class(
            stages if multi_stage else stages[0], n_microbatches=microbatches, loss_fn=loss_fn
        )
        if kind != "train" and self._plan.schedule in V_SCHEDULES:
            _keep_forwards(schedule)
        return schedule

    def _microbatches(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, training: bool) -> int:
        """The plan's microbatches; a training batch that does not split into them evenly is refused (unequal
        parts would weigh samples differently), a forward without gradients takes the most that divide it."""
        from torch.utils._pytree import tree_leaves

        count = self._plan.microbatch_count
        for value in tree_leaves((args, kwargs, target)):
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                samples = value.shape[0]
                if samples % count == 0:
                    return count
                if not training:
                    return max(divisor for divisor in range(1, count + 1) if samples % divisor == 0)
                raise ValueError(
                    f"A batch of {samples} samples does not split into {count} equal microbatches "
                    f"(PipelinePlan(microbatches={self._plan.microbatches})): give each rank a batch size that "
                    "is a multiple of the microbatches (drop_last=True for a ragged last batch)."
                )
        return count

    def _loss_on_every_stage(self, losses: list[torch.Tensor]) -> torch.Tensor:
        import torch.distributed as dist

        if self.is_last_stage:
            loss = torch.stack([loss.detach().float() for loss in losses]).mean()
        else:
            loss = torch.empty((), dtype=torch.float32, device=self._device)
        last_rank = self._plan.rank_of(self._plan.num_stages - 1, dist.get_world_size(self._group))
        dist.broadcast(loss, group=self._group, group_src=last_rank)
        self._last_loss = weakref.ref(loss)
        return loss

    def returned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is the loss of this pipeline's latest step."""
        return self._last_loss is not None and self._last_loss() is tensor


def _keep_forwards(schedule: Any) -> None:
    """Give a V-shaped schedule an order of forwards alone: each rank runs its stages' forwards microbatch after
    microbatch, each microbatch through its stages in order (what a stage waits for always ran before), with torch's
    own lowering to sends and receives. torch 2.13 runs a V schedule's backward actions under ``eval()`` too, and
    one that hands a gradient to the adjacent stage on the same rank then fails ("can't steal_bwd_input if this
    stage doesn't have backward"); its checks of an order insist on the backwards, so the order is set past them."""
    from torch.distributed.pipelining.schedules import FORWARD, _Action, _add_send_recv, _add_unshard_reshard

    ranks: dict[int, list[int]] = {}
    for stage, rank in schedule.stage_index_to_group_rank.items():
        ranks.setdefault(rank, []).append(stage)
    forwards = {
        rank: _add_unshard_reshard(
            [
                _Action(stage, FORWARD, microbatch)
                for microbatch in range(schedule._n_microbatches)
                for stage in sorted(stages)
            ]
        )
        for rank, stages in ranks.items()
    }
    schedule.pipeline_order_with_comms = _add_send_recv(
        forwards, stage_to_rank=schedule.stage_index_to_group_rank.__getitem__, num_stages=schedule._num_stages
    )
