"""FIS: StartExperiment of an `aws:ec2:send-spot-instance-interruptions` action interrupts each spot instance its
targets select (moto records the experiment and does nothing). What an interruption does to an instance (IMDS,
EC2's events, the termination) is the caller's: it is told the instance and the action's durationBeforeInterruption."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from spotcr_contracts import fis as fis_templates

from rehearsal.localaws import ACCOUNT, REGION, tags_of, wrap


def interrupt_spot_instances(
    patches: contextlib.ExitStack,
    interrupt: Callable[[str, float], None],
    may_interrupt: Callable[[Any, list[str]], bool],
) -> None:
    """Until `patches` closes, each experiment started calls `interrupt(instance_id, duration_s)` per target, once
    `may_interrupt(experiment, targets)` (FIS acting as the experiment's role) allows it; else the experiment fails
    and nothing is interrupted."""
    from moto.ec2.models import ec2_backends
    from moto.fis.models import FISBackend

    def start_experiment(original: Any) -> Any:
        def started_then_interrupting(backend: Any, *args: Any, **kwargs: Any) -> Any:
            started = original(backend, *args, **kwargs)
            experiment = backend.experiments[started["id"]]
            ec2 = ec2_backends[ACCOUNT][REGION]
            planned: list[tuple[str, float]] = []  # every target of every action, checked before any is interrupted
            for action in experiment.actions.values():
                if action.get("actionId") != fis_templates.ACTION_ID:
                    continue
                duration = fis_templates.duration_s(action.get("parameters", {}).get("durationBeforeInterruption"))
                for target_name in action.get("targets", {}).values():
                    targets = spot_targets(ec2, experiment.targets.get(target_name, {}))
                    if not may_interrupt(experiment, targets):
                        experiment.status = "failed"  # as FIS fails an experiment its role may not run
                        return started
                    planned += [(instance_id, duration) for instance_id in targets]
            for instance_id, duration in planned:
                interrupt(instance_id, duration)
            return started

        return started_then_interrupting

    wrap(patches, FISBackend, "start_experiment", start_experiment)


def spot_targets(ec2: Any, target: dict[str, Any]) -> list[str]:
    """The running spot instances an FIS target selects, by ARN or by tags and filters (selection mode ALL)."""
    if target.get("resourceType") != "aws:ec2:spot-instance":
        return []
    arns = target.get("resourceArns") or []
    wanted_tags = target.get("resourceTags") or {}
    states = [v for f in target.get("filters") or [] if f.get("path") == "State.Name" for v in f.get("values", [])]
    chosen = []
    for reservation in ec2.reservations.values():
        for instance in reservation.instances:
            tags = tags_of(ec2, instance.id)
            if arns and not any(arn.endswith(f"/{instance.id}") for arn in arns):
                continue
            if any(tags.get(key) != value for key, value in wanted_tags.items()):
                continue
            if states and instance.state not in states:
                continue
            if getattr(instance, "lifecycle", None) == "spot":
                chosen.append(instance.id)
    return chosen
