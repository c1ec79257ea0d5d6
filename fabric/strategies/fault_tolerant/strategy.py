"""Fault-tolerant data parallelism: torchft's quorum across replica groups, on top of the strategy inside a group
(:class:`FaultTolerantStrategy`), here DDP (:class:`FaultTolerantDDPStrategy`)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, ClassVar

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from fabric.plugins.io.checkpoint_io import PathType
from fabric.strategies.ddp import DDPStrategy
from fabric.strategies.fault_tolerant.gradient_buckets import GradientBuckets, average_in_group
from fabric.strategies.fault_tolerant.plan import DEFAULT_FT_TIMEOUT, EveryGroupHere, FaultTolerance, resolve_launch
from fabric.strategies.fault_tolerant.replica_groups import ReplicaGroups, import_torchft
from fabric.strategies.launchers.launcher import Launcher
from fabric.strategies.launchers.replica_groups import ReplicaGroupsLauncher
from fabric.strategies.parallel import ParallelStrategy

#: A state torchft sends a joining group: ``(load, state)``, ``state()`` on a healthy group, ``load`` on the joiner.
StateFunctions = tuple[Callable[[Any], None], Callable[[], Any]]


class FaultTolerantStrategy(ParallelStrategy):
    """Data parallelism that keeps training when a replica group dies, and lets a new one join, without a restart.

    Mixed in before the strategy a group runs inside (DDP: :class:`FaultTolerantDDPStrategy`; FSDP2 shards:
    :class:`~fabric.strategies.fault_tolerant.fsdp.FaultTolerantFSDPStrategy`), which decides what a rank's
    state is (:meth:`_module_state`, :meth:`_optimizer_state`) and what the first step needs.
    Each *replica group* is an ordinary Fabric job (``fabric run model``, ``torchrun``, a SLURM step, or
    ``python train.py``) of one or more processes, every group laid out alike.
    Across groups, torchft's lighthouse forms a quorum every step; the gradients are averaged over the groups in it,
    and the step commits on all of them or on none (a group that failed mid-step makes every group discard that
    update). A group that starts later, or again after a failure, receives the weights, optimizer state and step
    count of a healthy group before its first step, from memory, and trains on with them.

    The loop is Fabric's usual one; :attr:`committed_steps` is the run's step count, the same on every group::

        while fabric.strategy.committed_steps < total_steps:
            optimizer.zero_grad()
            fabric.backward(loss_of(next_batch()))
            optimizer.step()  # applied only if the step commits

    Args:
        replica_group: this group's index (``0`` to ``replica_groups - 1``); else ``FABRIC_FT_REPLICA_GROUP``;
            neither, in a process no launcher started: ``fabric.launch()`` starts every group on this machine
            (:class:`~fabric.strategies.launchers.replica_groups.ReplicaGroupsLauncher`).
        replica_groups: how many groups the run is planned for (each reads its share of the data); else
            ``FABRIC_FT_REPLICA_GROUPS``.
        min_replica_groups: the fewest groups a step may commit with (default 1).
        lighthouse: the torchft lighthouse, ``"host:port"``; else ``TORCHFT_LIGHTHOUSE``.
        ft_timeout: how long a gradient exchange across groups or a recovery from a peer may take.
        quorum_timeout: how long a step waits for the lighthouse's quorum (default: twice ``ft_timeout``, see
            :class:`~fabric.strategies.fault_tolerant.plan.FaultTolerance`).
        **kwargs: as the strategy inside the group (``timeout`` is the in-group process group's).
    """

    #: Whether torchft makes the groups' weights equal at the run's first step (each rank from the peer it assigns).
    syncs_first_step: ClassVar[bool] = True

    def __init__(
        self,
        *,
        replica_group: int | None = None,
        replica_groups: int | None = None,
        min_replica_groups: int = 1,
        lighthouse: str | None = None,
        ft_timeout: timedelta = DEFAULT_FT_TIMEOUT,
        quorum_timeout: timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        import_torchft()  # missing: say so at construction, not at the first step
        #: This group's place in the run, or, with no group index, every group to start here; validated here.
        self._launch_plan = resolve_launch(
            replica_group, replica_groups, min_replica_groups, lighthouse, ft_timeout, quorum_timeout
        )
        super().__init__(**kwargs)
        self._replica_groups: ReplicaGroups | None = None
        self._gradients: GradientBuckets | None = None
        self._modules: list[nn.Module] = []
        self._participants = 0
        #: The step last discarded, and how many times in a row (a step is retried until it commits).
        self._discarded_step: int | None = None
        self._discarded_tries = 0
        #: Inside ``no_backward_sync``: the gradients are not complete yet, so not averaged across the groups.
        self._accumulating = False
        #: This step's gradients were averaged across the groups (at the end of its backward).
        self._averaged = False

    @property
    def fault_tolerance(self) -> FaultTolerance:
        """This group's place in the run; a ``ValueError`` in a process given no group index, which starts every
        group instead (and trains in none)."""
        plan = self._launch_plan
        if isinstance(plan, EveryGroupHere):
            raise plan.unplaced_error()
        return plan

    @property
    @override
    def needs_launch(self) -> bool:
        return isinstance(self._launch_plan, EveryGroupHere) or super().needs_launch

    @property
    @override
    def launcher(self) -> Launcher | None:
        """With no group index, every group started from this process (:class:`ReplicaGroupsLauncher`); else the
        group's own launcher."""
        plan = self._launch_plan
        if not isinstance(plan, EveryGroupHere):
            return super().launcher
        if self.cluster_environment.creates_processes_externally:  # torchrun or SLURM started this group's ranks
            raise plan.unplaced_error()
        return ReplicaGroupsLauncher(plan.replica_groups, plan.lighthouse, self.num_processes)

    @property
    def replica_groups(self) -> ReplicaGroups:
        if self._replica_groups is None:
            raise RuntimeError("The replica groups are joined at launch: call fabric.launch() first.")
        return self._replica_groups

    @property
    def committed_steps(self) -> int:
        """Steps the run has committed, on every group alike (a joining group receives it from a peer)."""
        return self.replica_groups.committed_steps

    @property
    @override
    def data_parallel_shard(self) -> tuple[int, int]:
        """Every group reads its own share: ``replica_groups x`` the group's shares split the data."""
        plan = self.fault_tolerance
        shares, share = super().data_parallel_shard
        return plan.replica_groups * shares, plan.replica_group * shares + share

    @property
    @override
    def replica_group(self) -> int:
        return self.fault_tolerance.replica_group

    @property
    @override
    def batch_shares(self) -> int:
        """A group counts its own samples: the groups alive at a step are torchft's to know, not the plan's."""
        return super().data_parallel_shard[0]

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self._replica_groups is None:
            environment = self.cluster_environment
            self._replica_groups = ReplicaGroups(
                self.fault_tolerance,
                group_rank=self.global_rank,
                group_size=self.world_size,
                store_address=environment.main_address,
                store_port=environment.main_port,
                device=self.root_device,
                init_sync=self.syncs_first_step,
            )

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        module = super().setup_module(module)
        self._track(module)
        return module

    def _track(self, module: nn.Module) -> None:
        """Register a set-up module's state for joining groups (in set-up order, alike on every group)."""
        self.replica_groups.register_state("model", *self._module_state(module))
        self._modules.append(module)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self._gradients is not None:
            raise ValueError(
                f"{type(self).__name__} steps one optimizer (torchft commits once per step); got a second one, "
                f"{type(optimizer).__name__}. Put all parameter groups in one optimizer."
            )
        optimizer = super().setup_optimizer(optimizer)
        self.replica_groups.register_state("optimizer", *self._optimizer_state(optimizer))
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        self._gradients = GradientBuckets(
            parameters, self.replica_groups, final_when_accumulated=self._gradients_final_when_accumulated
        )
        return optimizer

    @override
    def optimizer_zero_grad(self, optimizer: Optimizer, set_to_none: bool = True) -> None:
        self.replica_groups.begin_step()  # the quorum forms during the forward
        super().optimizer_zero_grad(optimizer, set_to_none)

    @override
    def backward(self, tensor: Any, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """The backward, then (unless accumulating) the gradients averaged across the groups: clipping, and anything
        else that reads them before the step, sees the run's gradients, as under plain DDP. Their buckets are sent
        during the backward, as it completes them (see :attr:`_gradients_final_when_accumulated`)."""
        self.replica_groups.begin_step()
        gradients = self._gradients
        sending: AbstractContextManager[Any] = contextlib.nullcontext()
        if gradients is not None and not self._accumulating:
            sending = gradients.sending_during_backward()
        with sending:
            super().backward(tensor, module, *args, **kwargs)
        if not self._accumulating:
            self._average_gradients()

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager[Any]:
        inner = super().no_backward_sync(module, enabled)
        return self._accumulating_during(inner) if enabled else inner

    @contextlib.contextmanager
    def _accumulating_during(self, inner: AbstractContextManager[Any]) -> Iterator[None]:
        self._accumulating = True
        try:
            with inner:
                yield
        finally:
            self._accumulating = False

    def _average_gradients(self) -> None:
        if self._gradients is not None:
            self._gradients.average()
            self._averaged = True

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        """Step only if the step commits on all the groups (their gradients averaged by then)."""
        groups = self.replica_groups
        step = groups.steps_before
        if not self._averaged:  # gradients accumulated (or synced by hand) without a last backward outside
            self._average_gradients()
        self._averaged = False
        self._before_commit()
        committed = groups.commit()
        self._report(step, committed)
        self.step_discarded = not committed
        if not committed:
            return None
        self._after_commit(step)
        return super().optimizer_step(optimizer, closure)

    # --- what the strategy inside the group decides ---------------------------------------------------------------

    @property
    def _gradients_final_when_accumulated(self) -> bool:
        """Whether a parameter's gradient, when autograd's post-accumulate hook sees it, is this rank's final one
        for the step (so that it may be sent across the groups then); else the strategy reports each one when it is
        (:meth:`GradientBuckets.produced`)."""
        raise NotImplementedError

    def _module_state(self, module: nn.Module) -> StateFunctions:
        """What a joining group receives of a set-up module: this rank's part of it."""
        raise NotImplementedError

    def _optimizer_state(self, optimizer: Optimizer) -> StateFunctions:
        """What a joining group receives of the (set-up) optimizer: this rank's part of its state."""
        raise NotImplementedError

    def _before_commit(self) -> None:
        """Runs after the gradients' exchange (the quorum known), before the step commits."""

    def _after_commit(self, step: int) -> None:
        """Runs once the step (this group's step ``step``) committed, before the optimizer applies it."""

    # --- reports ---------------------------------------------------------------------------------------------------

    def _report(self, step: int, committed: bool) -> None:
        """One line (rank 0 of the group) when this group joins, a step is discarded (once, however often it is tried
        again while groups are missing, and once more when it commits after several tries), or the groups taking
        part change."""
        groups = self.replica_groups
        plan = self.fault_tolerance
        if groups.joined_at is not None:  # it took no part in this step: it received the others' state
            self._participants = groups.participants + 1
            self._say(
                f"fabric: replica group {plan.replica_group} joined the run at step {groups.joined_at}: weights, "
                "optimizer state and step count received from a peer. Its data loaders were not moved: where batches "
                "follow the step, start them at this one."
            )
            return
        if not committed:
            self._discarded_tries = self._discarded_tries + 1 if step == self._discarded_step else 1
            self._discarded_step = step
            if self._discarded_tries == 1:  # a step retried while groups are missing is said once, not per try
                self._say(
                    f"fabric: step {step} was not committed (a replica group failed during it, or fewer than "
                    f"min_replica_groups={plan.min_replica_groups} took part): its update was discarded."
                )
            return
        if step == self._discarded_step:
            if self._discarded_tries > 1:
                self._say(f"fabric: step {step} committed after {self._discarded_tries} discarded tries.")
            self._discarded_step = None
        if groups.participants != self._participants:
            self._participants = groups.participants
            missing = plan.replica_groups - self._participants
            self._say(
                f"fabric: from step {step}, {self._participants} of {plan.replica_groups} replica groups train"
                + (f"; the data share of the {missing} missing is not trained while they are away." if missing else ".")
            )

    def _say(self, line: str) -> None:
        if self.global_rank == 0:
            print(line, file=sys.stderr, flush=True)

    @override
    def share_with_joining_replicas(
        self, name: str, load: Callable[[dict[str, Any]], None], state: Callable[[], dict[str, Any]]
    ) -> None:
        """Registered with torchft like the weights: a joining group receives ``state()`` of a healthy one during the
        step it joins at (the batch in flight counted as done), and ``load``s it before that step's update."""
        self.replica_groups.register_state(name, load, state)

    @override
    def run_state(self) -> dict[str, Any]:
        """The run's committed steps (torchft's step and batch counts), so that a run restarted from the checkpoint
        after every group was lost counts on from there."""
        return {"torchft_manager": self.replica_groups.checkpoint_state()}

    @override
    def load_run_state(self, saved: dict[str, Any] | None, path: PathType) -> None:
        if saved is None or "torchft_manager" not in saved:
            self._say(
                f"fabric: {os.fspath(path)} records no committed steps (a run that was not fault-tolerant saved it): "
                f"committed_steps stays {self.committed_steps}."
            )
            return
        self.replica_groups.restore(saved["torchft_manager"])

    @override
    def teardown(self) -> None:
        if self._replica_groups is not None:
            self._replica_groups.shutdown()
            self._replica_groups = None
        super().teardown()

    @override
    def __repr__(self) -> str:
        plan = self._launch_plan
        if isinstance(plan, EveryGroupHere):
            return f"{type(self).__name__}(replica_groups={plan.replica_groups}, lighthouse={plan.lighthouse!r})"
        return (
            f"{type(self).__name__}(replica_group={plan.replica_group}, replica_groups={plan.replica_groups}, "
            f"lighthouse={plan.lighthouse!r})"
        )


class FaultTolerantDDPStrategy(FaultTolerantStrategy, DDPStrategy):
    """Fault-tolerant replica groups (:class:`FaultTolerantStrategy`) that each hold a full copy of the model, DDP
    among a group's processes; ``**kwargs`` as :class:`~fabric.strategies.DDPStrategy`'s."""

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        if self.world_size == 1:
            self._track(module)  # one process: no DDP wrapper, nothing to synchronise inside the group
            return module
        wrapped = super().setup_module(module)
        if self._ddp_kwargs["find_unused_parameters"] or self._ddp_kwargs["static_graph"]:
            # Whether a parameter has a gradient in the group is known only after the backward (DDP gives it one
            # where another process of the group used it): the buckets go out then.
            return wrapped
        # A lambda: DDP refuses a hook whose annotations are strings (postponed annotations), and the buckets are
        # built with the optimizer, after the module.
        hook = lambda group, bucket: average_in_group(group, bucket, self._gradients)  # noqa: E731
        wrapped.register_comm_hook(wrapped.process_group, hook)  # type: ignore[operator]
        return wrapped

    @property
    @override
    def _gradients_final_when_accumulated(self) -> bool:
        """One process: its gradients are final at the hook. Several: DDP's reducer averages them inside the group
        after it, in its buckets, which :func:`average_in_group` reports as they complete (unless parameters may
        go unused, see :meth:`setup_module`)."""
        return self.world_size == 1

    @override
    def _module_state(self, module: nn.Module) -> StateFunctions:
        return module.load_state_dict, module.state_dict

    @override
    def _optimizer_state(self, optimizer: Optimizer) -> StateFunctions:
        return optimizer.load_state_dict, optimizer.state_dict

    @override
    def _after_commit(self, step: int) -> None:
        """At the run's first step torchft syncs groups that started with different weights, but each rank of a
        group recovers from the peer group torchft assigns to its rank (load balancing), so the ranks of one group
        can receive different weights, and different averaged gradients (each rank's own recovering peer sends
        zeros). Rank 0's are the same in every group: every rank takes them."""
        if step != 0 or self.world_size == 1:
            return
        for module in self._modules:
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=0)
                if tensor.grad is not None:
                    dist.broadcast(tensor.grad, src=0)
