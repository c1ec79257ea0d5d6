"""Every replica group of a fault-tolerant run on this machine (``fabric run model --replica-groups=N`` without
``--replica-group``): torchft's lighthouse (unless ``--lighthouse`` names one), then one supervisor per group
(:func:`fabric.strategies.launchers.replica_groups.run_replica_groups`).

Each group runs exactly as ``--replica-group=I`` would (:func:`fabric_cli.runner.run`). With ``--max-restarts=K`` a
failed group is started again in a run dir ``groupI-restartN`` and on a fresh rendezvous port (the old store's may
linger).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fabric.strategies.launchers.replica_groups import LocalReplicaGroups, run_replica_groups
from fabric.utilities.ports import find_free_port
from fabric_cli.plan import GroupsPlan
from fabric_cli.runner import run


def run_groups(plan: GroupsPlan) -> int:
    """Start the lighthouse and the groups, wait for every group; the exit code the CLI ends with."""

    def run_group(group: int, restart: int) -> int:
        launch = plan.groups[group]
        if restart:
            launch = dataclasses.replace(launch, run_dir=_restart_dir(plan, group, restart), main_port=find_free_port())
        return run(launch)

    return run_replica_groups(
        LocalReplicaGroups(
            count=len(plan.groups),
            run_group=run_group,
            lighthouse_bind=plan.lighthouse_bind,
            lighthouse_log=plan.run_dir / "lighthouse.log",
            max_restarts=plan.max_restarts,
            describe_restart=lambda group, restart: f", run dir {_restart_dir(plan, group, restart)}",
        )
    )


def _restart_dir(plan: GroupsPlan, group: int, restart: int) -> Path:
    run_dir = plan.groups[group].run_dir
    return run_dir.with_name(f"{run_dir.name}-restart{restart}")
