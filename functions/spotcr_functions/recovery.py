"""Interruptions and the recovery workflow's steps: fence, order the final dump, launch, hand over, restore."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from aws_lambda_powertools import Logger
from botocore.exceptions import ClientError
from spotcr_contracts import commands, names, results, tags
from spotcr_contracts.names import client_token
from spotcr_contracts.protocol import final_dump_taker, job_gone_from, parse_time, restarted

from spotcr_functions import agent_events, checkpoints, efs_access, final_dumps, jobs, rendezvous
from spotcr_functions.cloud import CAPACITY_ERRORS, NOT_RUNNING_STATES, Instance, Throttled, error_code
from spotcr_functions.deps import Deps
from spotcr_functions.gpus import matching_fallbacks
from spotcr_functions.models import ACTIVE, ENDED, JobRecord, Status
from spotcr_functions.observability import SERVICE, Metric
from spotcr_functions.registry import (
    FINAL_DUMP_COMMAND,
    RESTORE_KEYS,
    WAIT_KEYS,
    StaleGeneration,
    early_ready_key,
    restore_key,
)

logger = Logger(service=SERVICE, child=True)

MAX_OVERRIDES = 40  # per spot fleet; CreateFleet allows more, a job names far fewer


class CapacityUnavailable(Exception):
    """RunInstances found no capacity for this candidate; the workflow moves down the list."""


class LaunchFailed(Exception):
    """The spot fleet failed for a reason no other candidate avoids (not capacity): the recovery fails, named."""


class HandOverTimedOut(Exception):
    """The EBS volume did not reach the backup in time; the workflow marks the job FAILED and notifies."""


class PrimaryStillRunning(Exception):
    """The interrupted instance may still run the job; the workflow retries the restore until it is terminated."""


class NoCapacity(Exception):
    """No candidate launched a lost node's backup: the recovery fails, as the workflow's NoCapacity does."""


class NodeWithoutBackup(Exception):
    """A node lost during this recovery has no backup yet: the workflow launches one (LaunchLostNodes), then
    comes back to the restore."""


class NodeBackupNotReady(Exception):
    """A lost node's backup has not reported ready yet: the workflow retries the restore until it has."""


def execution_name(record: JobRecord) -> str:
    """The recovery execution of the record's interruption (names.execution_name)."""
    return names.execution_name(record.job_id, record.generation, record.recovering_from, record.interrupted_at)


def on_interruption_warning(
    deps: Deps, instance_id: str, warned_at: str, action: str = "terminate", source: str = "spot"
) -> dict[str, Any]:
    """Fence the generation, order the final dump, start the recovery workflow. Duplicates do nothing more.

    terminate, stop and hibernate are recovered alike: a stopped or hibernated instance keeps the job's processes (in
    RAM for hibernate) and EC2 may start it again later, so the workflow terminates it before the backup restores
    (see _retire_primary). Hibernation may begin with no two-minute notice, so the final dump may not come.
    """
    record = deps.registry.by_instance(instance_id)
    if record is None:
        return on_backup_down(deps, instance_id, warned_at, reason="interruption-warning", final_dump=True)
    if record.node_count:
        reason = f"{source}-interruption:{action}"
        return _node_interrupted(deps, record, instance_id, warned_at, reason=reason, final_dump=True)
    bumped = _bump(deps, record, instance_id, warned_at, final_dump=True)
    if bumped is None:
        return _already_recovering(deps, record.job_id, instance_id)
    _recover_with_final_dump(deps, bumped, instance_id, reason=f"{source}-interruption:{action}")
    return {
        "action": "recovering",
        "job_id": bumped.job_id,
        "generation": bumped.generation,
        "final_dump": True,
        "instance_action": action,
    }


def on_instance_down(deps: Deps, instance_id: str, state: str, at: str) -> dict[str, Any]:
    """The missed-warning case: the job's current instance went away and no warning started recovery."""
    record = deps.registry.by_instance(instance_id)
    if record is None:
        return _other_instance_down(deps, instance_id, state, at)
    if record.status == Status.COMPLETED and state == "terminated":
        return _delete_finished_volume(deps, record, instance_id)
    if record.node_count:  # node 0 (a job over several VMs), whether the job runs or recovers another node
        return _node_interrupted(deps, record, instance_id, at, reason=f"missed-warning:{state}", final_dump=False)
    if record.status not in ACTIVE:
        return _already_recovering(deps, record.job_id, instance_id)
    bumped = _bump(deps, record, instance_id, at)
    if bumped is None:
        return _already_recovering(deps, record.job_id, instance_id)
    logger.warning("instance went down without a warning; recovering from the newest checkpoint", job_id=record.job_id)
    _start(deps, bumped, instance_id, reason=f"missed-warning:{state}", final_dump=False)
    return {"action": "recovering", "job_id": bumped.job_id, "generation": bumped.generation, "final_dump": False}


def _other_instance_down(deps: Deps, instance_id: str, state: str, at: str) -> dict[str, Any]:
    """An instance that is no job's own went: a finished job's node other than node 0 (its EBS volume goes with
    it), else a backup, or a node of a job over several VMs (on_backup_down)."""
    tagged = jobs.record_tagged_on(deps, instance_id) if state == "terminated" else None
    if tagged is not None and tagged.status == Status.COMPLETED and tagged.node_of(instance_id):
        return _delete_finished_volume(deps, tagged, instance_id)
    return on_backup_down(deps, instance_id, at, reason=f"missed-warning:{state}", final_dump=False)


def _node_interrupted(
    deps: Deps, record: JobRecord, instance_id: str, at: str, *, reason: str, final_dump: bool
) -> dict[str, Any]:
    """A node of a job over several VMs was warned or lost: the whole job recovers (docs/design/multinode.md). The
    fencing write names the node; a warning's final dump goes to node 0, whose agent dumps every node; a backup in
    the job's subnet takes over the node's address; node 0 then restores every node from the job's checkpoint.

    Another node interrupted while the recovery runs, before its restore is ordered (a wave warns several nodes at
    once), joins it: the same restore brings it back on a backup of its own (_another_node_lost). After the order,
    or when its backup goes, the job fails, saying so, with its newest checkpoint named. The recovered node's
    backup lost while it restores starts the next cycle as for one VM."""
    if record.status in ENDED:
        return {"action": "ignored", "reason": f"job is {record.status.value}", "job_id": record.job_id}
    if record.status == Status.RECOVERING and instance_id == record.backup_instance_id:
        return _backup_lost(deps, record, instance_id, at, reason=reason, final_dump=final_dump)
    if record.status == Status.RECOVERING and instance_id in record.backups():
        return _nodes_lost(deps, record, f"the backup {instance_id} of a lost node went ({reason})")
    node = record.node_of(instance_id)
    if record.status == Status.RECOVERING and instance_id != record.recovering_from and node is not None:
        return _another_node_lost(deps, record, node.index, instance_id, at=at, reason=reason)
    bumped = deps.registry.bump_node(record.job_id, instance_id, at, final_dump=final_dump)
    if bumped is None:
        return _not_bumped(deps, record.job_id, instance_id, at=at, reason=reason)
    logger.warning(
        "a node of a job over several VMs was interrupted", job_id=record.job_id, node=bumped.interrupted_node
    )
    if final_dump:
        _recover_with_final_dump(deps, bumped, instance_id, reason=reason)
    else:
        _start(deps, bumped, instance_id, reason=reason, final_dump=False)
    return {
        "action": "recovering",
        "job_id": bumped.job_id,
        "generation": bumped.generation,
        "final_dump": final_dump,
        "node": bumped.interrupted_node,
    }


def _not_bumped(deps: Deps, job_id: str, instance_id: str, *, at: str, reason: str) -> dict[str, Any]:
    """The fencing write found the job no longer active: another node's warning of the same wave fenced it first
    (this node then joins that recovery), or this event is a duplicate."""
    fresh = deps.registry.get(job_id)
    node = fresh.node_of(instance_id) if fresh else None
    if fresh and node and fresh.status == Status.RECOVERING and fresh.recovering_from != instance_id:
        return _another_node_lost(deps, fresh, node.index, instance_id, at=at, reason=reason)
    return _already_recovering(deps, job_id, instance_id)


def _another_node_lost(
    deps: Deps, record: JobRecord, index: int, instance_id: str, *, at: str, reason: str
) -> dict[str, Any]:
    """Node `index` went while another node's recovery runs. Before the restore is ordered it joins the recovery
    (Registry.add_lost_node): the checkpoint is the job's (a warning's final dump, already ordered, dumps every node;
    with none, the newest one), and the restore step waits until the node has a backup of its own, which the
    workflow launches (launch_lost_backups), then moves its address there too. After the order, the job fails
    (_nodes_lost): the restore in flight would miss the node."""
    if (lost := record.lost_nodes.get(index)) is not None and lost.instance_id == instance_id:
        return _already_recovering(deps, record.job_id, instance_id)
    added = deps.registry.add_lost_node(record, index, instance_id, at)
    if added is not None:
        logger.warning("another node went during the recovery; the same restore recovers it", node=index)
        return {"action": "joined", "job_id": record.job_id, "generation": record.generation, "node": index}
    fresh = deps.registry.get(record.job_id)
    if fresh is None or fresh.generation != record.generation or fresh.status != Status.RECOVERING:
        return _already_recovering(deps, record.job_id, instance_id)
    if index in fresh.lost_nodes or fresh.node_of(instance_id) is None:
        return _already_recovering(deps, record.job_id, instance_id)
    return _nodes_lost(deps, fresh, f"node {index} ({instance_id}, {reason}) went after the restore was ordered")


def _nodes_lost(deps: Deps, record: JobRecord, why: str) -> dict[str, Any]:
    """A node went where the recovery cannot take it in (its restore already ordered, or the backup launched for
    it gone): the recovery of this generation fails (rule 12) rather than restore a job missing a node: the job is
    FAILED, its nodes and backups retired, the workflow's waits released (it then finds the job moved on), the
    failure notified."""
    cause = f"{why} while node {record.interrupted_node} recovers (docs/design/multinode.md)"
    if record.checkpoint_id:
        cause += f"; the job's newest checkpoint is {record.checkpoint_id}"
    failed = deps.registry.fail_recovery(record.job_id, record.generation, cause, deps.iso_now())
    if failed is None:
        return {"action": "ignored", "reason": "the job moved on", "job_id": record.job_id}
    logger.error("a node went where the recovery cannot take it in; the job failed", job_id=record.job_id, why=why)
    efs_access.close_for(deps, failed)
    instances = [*(n.instance_id for n in record.nodes), record.recovering_from, *record.backups()]
    instances += [lost.instance_id for lost in record.lost_nodes.values()]
    jobs.retire(deps, list(dict.fromkeys(i for i in instances if i)), cause)
    for key in WAIT_KEYS:
        token = record.token(key)
        if token and token.get("generation") == record.generation:
            deps.cloud.complete_task(str(token["token"]), {}, error="StaleGeneration", cause=cause)
    deps.metric(Metric.RECOVERIES_FAILED, "Count", 1)
    deps.cloud.notify(deps.settings.failure_topic_arn, f"spotcr job {record.job_id} failed", cause)
    return {"action": "failed", "job_id": record.job_id, "reason": cause}


def _delete_finished_volume(deps: Deps, record: JobRecord, instance_id: str) -> dict[str, Any]:
    """A completed EBS job's volume goes with its instance (a job over several VMs: each node's with the node's
    instance), unless the deployment keeps finished volumes."""
    node = record.node_of(instance_id)
    volume_id = node.volume_id if node else record.volume_id
    if record.storage != "ebs" or not volume_id or deps.settings.keep_finished_volumes:
        return {"action": "ignored", "reason": "job completed; nothing to delete"}
    if not deps.cloud.delete_volume(volume_id):
        logger.warning("finished job's volume still attached; kept", job_id=record.job_id, volume_id=volume_id)
        return {"action": "ignored", "reason": f"volume {volume_id} still attached"}
    deps.registry.forget_volume(record.job_id, record.generation, deps.iso_now(), node.index if node else None)
    logger.info("finished job's volume deleted", job_id=record.job_id, volume_id=volume_id)
    return {"action": "volume-deleted", "job_id": record.job_id, "volume_id": volume_id}


def _bump(deps: Deps, record: JobRecord, instance_id: str, at: str, final_dump: bool = False) -> JobRecord | None:
    if record.status not in ACTIVE:
        return None
    job_id, generation = record.job_id, record.generation
    return deps.registry.bump_generation(job_id, instance_id, generation, at, read=record, final_dump=final_dump)


def _already_recovering(deps: Deps, job_id: str, instance_id: str) -> dict[str, Any]:
    current = deps.registry.get(job_id)
    if current and current.status == Status.RECOVERING and current.recovering_from == instance_id:
        # A retry after a crash (or a throttled StartExecution) between the fencing write and StartExecution still
        # starts the workflow, once; it waits for the final dump if the fencing write was a warning's (which records
        # the order with it: sent since, or left to the workflow's wait to send).
        ordered = current.extra.get(FINAL_DUMP_COMMAND) or {}
        taker = final_dump_taker(current)
        final_dump = ordered.get("generation") == current.generation and ordered.get("instance_id") == taker
        started = _start(deps, current, instance_id, reason="retry", final_dump=final_dump)
        logger.info("duplicate event: recovery already under way", job_id=job_id, started_now=started)
        return {"action": "duplicate", "job_id": job_id, "generation": current.generation}
    logger.info("event for an instance the job no longer depends on", job_id=job_id, instance_id=instance_id)
    return {"action": "ignored", "reason": "job is not active on this instance", "job_id": job_id}


def _recover_with_final_dump(deps: Deps, record: JobRecord, instance_id: str, reason: str) -> None:
    """Send the fenced record's final-dump order with every other one queued meanwhile (final_dumps),
    then start the workflow, so that a wave's backups launch at once; orders a throttle kept back are tried again
    after that. The agent's own IMDS poll has begun the dump meanwhile; the command, once there, records it. The
    order goes to the instance that takes the final dump (rule 6: node 0's for a job over several VMs)."""
    throttled = final_dumps.send(deps, [final_dumps.order_of(record, final_dump_taker(record) or instance_id)])
    _start(deps, record, instance_id, reason=reason, final_dump=True)
    if throttled:
        final_dumps.send(deps, for_s=final_dumps.SEND_S)


def order_deferred_final_dump(deps: Deps, job_id: str, generation: int) -> None:
    """The final-dump wait begins: until the warning's order is sent, send the outbox (final_dumps rule 5), and
    leave as `Throttled` (which the wait's Retry waits out) while the order is not sent. An order SSM refused for
    anything but its rate has resumed the wait with FinalDumpNotDelivered (final_dumps rule 4)."""
    record = deps.registry.get(job_id)
    if record is None or record.generation != generation or record.status != Status.RECOVERING:
        return  # moved on: storing the token finds out
    ordered = record.extra.get(FINAL_DUMP_COMMAND) or {}
    if not _unsent(record, ordered):
        return
    held_since = (deps.now() - parse_time(record.interrupted_at or deps.iso_now())).total_seconds()
    lost = held_since >= final_dumps.HOLD_S  # its sender died holding it: send it again
    final_dumps.send(deps, [final_dumps.order_of(record, str(ordered["instance_id"]))] if lost else [])
    after = deps.registry.get(job_id)
    if (
        after is not None
        and after.generation == generation
        and _unsent(after, after.extra.get(FINAL_DUMP_COMMAND) or {})
    ):
        raise Throttled(f"job {job_id}: the final-dump order of generation {generation} is not sent yet")
    logger.info("final dump order sent", job_id=job_id, generation=generation)


def _unsent(record: JobRecord, ordered: dict[str, Any]) -> bool:
    """The warning ordered this generation's final dump, and no command carried it, nor was it refused."""
    arrival = record.arrival("final-dump") or {}
    answered = arrival.get("generation") == record.generation
    return ordered.get("generation") == record.generation and not ordered.get("command_id") and not answered


def recovery_input(record: JobRecord, instance_id: str, reason: str, final_dump: bool, settings: Any) -> dict[str, Any]:
    """The recovery workflow's input for a fenced record (`settings`: any object with the Settings wait fields)."""
    return {
        "job_id": record.job_id,
        "generation": record.generation,
        "interrupted_instance_id": instance_id,
        "interrupted_at": record.interrupted_at,
        "reason": reason,
        "final_dump": final_dump,
        "timing": {
            "final_dump_seconds": settings.final_dump_wait_s,
            "backup_ready_seconds": settings.backup_ready_wait_s,
            "restore_seconds": settings.restore_wait_s,
            "poll_seconds": settings.poll_s,
        },
    }


def _start(deps: Deps, record: JobRecord, instance_id: str, reason: str, final_dump: bool) -> bool:
    settings = deps.settings
    payload = recovery_input(record, instance_id, reason, final_dump, settings)
    name = execution_name(record)
    started = deps.cloud.start_recovery(settings.recovery_state_machine_arn, name, payload)
    logger.info("recovery workflow", execution=name, started=started, reason=reason)
    return started


def _current(deps: Deps, job_id: str, generation: int) -> JobRecord:
    record = deps.registry.get(job_id)
    if record is None or record.generation != generation or record.status != Status.RECOVERING:
        raise StaleGeneration(f"job {job_id} is no longer recovering generation {generation}")
    return record


def plan(deps: Deps, job_id: str, generation: int) -> dict[str, Any]:
    """Backup candidates, tried in order: spot in one instant fleet over the job's type and its fallback types in
    each stack subnet (its own first), then on demand in the job's own subnet.

    An EBS job's spot candidates are AZ-major: first every type in the volume's AZ, then the other AZs, since a
    backup elsewhere waits for the volume to move through a snapshot (minutes, then lazily loaded blocks)."""
    record = _current(deps, job_id, generation)
    stack_subnets = deps.settings.subnet_ids
    if not stack_subnets or record.node_count:  # a node's address moves only within its subnet
        subnets = [(record.subnet_id, record.az)]
    else:
        # Only the stack's subnets have the routes and endpoints a job VM needs; the job's own comes first.
        subnets = deps.cloud.subnets(sorted(stack_subnets, key=lambda s: s != record.subnet_id))
        if not subnets:
            raise ValueError(f"none of the stack's subnets exists: {', '.join(stack_subnets)}")
    home = subnets[0]
    types = (record.instance_type, *_restorable_fallbacks(deps, record))
    if record.storage == "ebs":
        zones = [[s for s in subnets if s[1] == record.az], [s for s in subnets if s[1] != record.az]]
    else:
        zones = [subnets]
    candidates: list[dict[str, Any]] = [
        {
            "spot": True,
            "overrides": [
                {"instance_type": instance_type, "subnet_id": subnet_id, "az": az}
                for instance_type in types
                for subnet_id, az in zone
            ][:MAX_OVERRIDES],
        }
        for zone in zones
        if zone
    ]
    candidates.append({"instance_type": record.instance_type, "subnet_id": home[0], "az": home[1], "spot": False})
    image = _backup_image(deps, record)  # once per recovery (one DescribeImages): every candidate launches from it
    candidates = [{**candidate, **image} for candidate in candidates]
    # `nodes`: a job over several VMs (LaunchLostNodesEarly launches the backups of nodes lost with the first).
    return {
        "storage": record.storage,
        "candidates": candidates,
        "candidate_count": len(candidates),
        "nodes": record.node_count,
    }


def _restorable_fallbacks(deps: Deps, record: JobRecord) -> list[str]:
    """The job's fallback types that can restore it: for a GPU type, only those with the same GPU model and count."""
    if not record.fallback_types:
        return []
    gpus = deps.cloud.instance_gpus([record.instance_type, *record.fallback_types])
    kept, dropped = matching_fallbacks(record.instance_type, record.fallback_types, gpus)
    for fallback, reason in dropped.items():
        logger.warning("fallback type not used", job_id=record.job_id, instance_type=fallback, reason=reason)
    return kept


def launch_backup(deps: Deps, job_id: str, generation: int, index: int, candidate: dict[str, Any]) -> dict[str, Any]:
    record = _current(deps, job_id, generation)
    if candidate.get("image_warning"):
        _warn_image(deps, record, candidate["image_warning"])
    token = client_token(execution_name(record), str(index))
    instance = _launch(deps, record, candidate, node=record.interrupted_node, token=token, what=f"candidate {index}")
    updated = deps.registry.record_backup(job_id, generation, instance.instance_id, instance.az, deps.iso_now())
    if updated is None:
        deps.cloud.terminate_instance(instance.instance_id)
        raise StaleGeneration(f"job {job_id} moved on while its backup launched")
    early = updated.arrival(early_ready_key(instance.instance_id))
    if early and early.get("generation") == generation:
        # Its agent reported ready, or its boot failed, before this write landed (agent_events kept the report):
        # rule 9.
        failed, cause = str(early.get("error") or ""), str(early.get("cause") or "")
        logger.info("the backup reported before it was recorded", job_id=job_id, error=failed or None)
        output = early.get("output") or {}
        rendezvous.arrive(deps, job_id, "backup-ready", generation, output, error=failed, cause=cause)
    market = "spot" if candidate["spot"] else "on-demand"
    logger.info("backup launched", job_id=job_id, instance_id=instance.instance_id, az=instance.az, market=market)
    return {
        "instance_id": instance.instance_id,
        "az": instance.az,
        "instance_type": instance.instance_type,
        "market": market,
    }


def launch_lost_backups(deps: Deps, job_id: str, generation: int, candidates: list[dict[str, Any]]) -> dict[str, Any]:
    """A backup for each node lost during this recovery that has none, right after the recovered node's backup
    launched (LaunchLostNodesEarly) and again when the restore step found one without (NodeWithoutBackup): the
    plan's candidates in order, each backup tagged with its node. No capacity for one fails the recovery
    (NoCapacity), as it does for the first."""
    record = _current(deps, job_id, generation)
    launched = {}
    for index, lost in record.lost_nodes.items():
        if lost.backup:
            continue
        for number, candidate in enumerate(candidates):
            token = client_token(execution_name(record), f"node-{index}-{number}")
            try:
                what = f"candidate {number} for node {index}"
                instance = _launch(deps, record, candidate, node=index, token=token, what=what)
            except CapacityUnavailable:
                continue
            if deps.registry.record_lost_backup(job_id, generation, index, instance.instance_id, deps.iso_now()):
                launched[str(index)] = instance.instance_id
                logger.info("lost node's backup launched", job_id=job_id, node=index, instance_id=instance.instance_id)
                break
            deps.cloud.terminate_instance(instance.instance_id)
            raise StaleGeneration(f"job {job_id} moved on while node {index}'s backup launched")
        else:
            raise NoCapacity(f"job {job_id}: no candidate launched a backup for node {index} in its subnet")
    return {"launched": launched}


def _launch(
    deps: Deps, record: JobRecord, candidate: dict[str, Any], *, node: int | None, token: str, what: str
) -> Instance:
    """One backup from one candidate (spot fleet or on demand), tagged for the job's run and generation and, for a
    job over several VMs, with the node whose share and address it takes over. CapacityUnavailable: none there."""
    backup_tags = {**record.tags, tags.MODE: "restore", tags.GENERATION: str(record.generation)}
    if record.run_id:
        backup_tags[tags.RUN] = record.run_id  # the backup serves this run: it restores only this run's checkpoints
    if node is not None:
        backup_tags[tags.NODE] = str(node)
    settings = deps.settings
    # The version is explicit: $Default stays version 1, whose user data may name an agent asset since replaced.
    template = (settings.launch_template_id, settings.launch_template_version)
    image_id = candidate.get("image_id", record.image_id)  # a plan made before plans named it: the job's own
    try:
        if candidate["spot"]:
            overrides = candidate.get("overrides") or [candidate]  # a plan made before fleets named one
            instance = _launch_spot(deps, template, overrides, image_id=image_id, backup_tags=backup_tags, token=token)
        else:
            instance = deps.cloud.run_instance(
                launch_template=template,
                instance_type=candidate["instance_type"],
                subnet_id=candidate["subnet_id"],
                image_id=image_id,
                tags=backup_tags,
                client_token=token,
            )
    except ClientError as error:
        code = error_code(error)
        if code in CAPACITY_ERRORS:
            logger.info("no capacity for this candidate", job_id=record.job_id, candidate=candidate, error=code)
            raise CapacityUnavailable(f"{code}: {what}") from error
        raise
    return instance


def _launch_spot(
    deps: Deps,
    template: tuple[str, str],
    overrides: list[dict[str, str]],
    *,
    image_id: str,
    backup_tags: dict[str, str],
    token: str,
) -> Instance:
    instance, errors = deps.cloud.launch_spot(
        launch_template=template, overrides=overrides, image_id=image_id, tags=backup_tags, client_token=token
    )
    if instance is not None:
        return instance
    codes = sorted({code for code, _ in errors})
    failed = [f"{code}: {message}" for code, message in errors if code not in CAPACITY_ERRORS]
    if failed:
        raise LaunchFailed(f"the spot fleet launched no backup: {'; '.join(failed)}"[:1000])
    logger.info("no spot capacity in this fleet", overrides=overrides, errors=codes)
    raise CapacityUnavailable(f"{', '.join(codes) or 'no instance'}: {len(overrides)} spot candidates")


def _backup_image(deps: Deps, record: JobRecord) -> dict[str, str]:
    """The AMI the job's instance runs, which its checkpoints need: {"image_id"}, "" (the template's, resolved at
    deploy) when none is recorded or it is gone, and then {"image_warning"} says why."""
    if not record.image_id or deps.cloud.image_exists(record.image_id):
        return {"image_id": record.image_id}
    warning = (
        f"image {record.image_id} of the job's instance is gone (deregistered): the backup launches from the "
        "launch template's image, whose agent may refuse a checkpoint taken on another image"
    )
    return {"image_id": "", "image_warning": warning}


def _warn_image(deps: Deps, record: JobRecord, warning: str) -> None:
    """The record says why its backup launches from the template's image."""
    logger.warning("job's image gone; backup launches from the template's", job_id=record.job_id, warning=warning)
    deps.registry.record_image_warning(record.job_id, record.generation, warning)


def move_volume(deps: Deps, job_id: str, generation: int) -> dict[str, Any]:  # noqa: PLR0911 (one step per state)
    """One step of the EBS hand-over; the workflow calls it again after a wait until it says done."""
    record = _current(deps, job_id, generation)
    if record.storage != "ebs" or record.volume_id is None or record.backup_instance_id is None or not record.backup_az:
        raise ValueError(f"job {job_id} has no EBS volume or backup to hand over")
    cloud = deps.cloud
    volume_id = record.handover_volume_id or record.volume_id
    volume = cloud.volume(volume_id)
    if volume is None:
        raise ValueError(f"job {job_id}: volume {volume_id} does not exist")
    attachments = [a for a in volume.get("Attachments", []) if a.get("State") in ("attaching", "attached")]
    if any(a["InstanceId"] == record.backup_instance_id for a in attachments):
        return {"done": True, "volume_id": volume_id}
    _check_handover_deadline(deps, record, volume_id, volume["State"])
    if volume["State"] == "in-use" and attachments:
        cloud.detach_volume(volume_id, attachments[0]["InstanceId"])
        return {"done": False, "step": "detaching"}
    if volume["State"] != "available":
        return {"done": False, "step": f"volume {volume['State']}"}
    if volume["AvailabilityZone"] == record.backup_az:
        cloud.attach_volume(volume_id, record.backup_instance_id)
        return {"done": False, "step": "attaching"}
    # EBS is zonal: the backup moved to another AZ, so the volume moves through a snapshot.
    if record.handover_snapshot_id is None:
        snapshot_id = cloud.create_snapshot(
            volume_id, {tags.JOB: job_id, tags.GENERATION: str(generation), tags.STACK: deps.settings.stack_name}
        )
        deps.registry.record_handover(job_id, generation, snapshot_id=snapshot_id)
        return {"done": False, "step": "snapshotting"}
    state = cloud.snapshot_state(record.handover_snapshot_id)
    if state == "error":
        raise RuntimeError(f"job {job_id}: snapshot {record.handover_snapshot_id} failed")
    if state != "completed":
        return {"done": False, "step": f"snapshot {state}"}
    new_volume_id = cloud.create_volume(
        az=record.backup_az,
        size_gib=deps.settings.ebs_volume_gib,
        tags={tags.JOB: job_id, tags.GENERATION: str(generation), tags.STACK: deps.settings.stack_name},
        client_token=client_token(execution_name(record), "volume"),
        snapshot_id=record.handover_snapshot_id,
    )
    deps.registry.record_handover(job_id, generation, volume_id=new_volume_id)
    return {"done": False, "step": "creating volume"}


def _check_handover_deadline(deps: Deps, record: JobRecord, volume_id: str, state: str) -> None:
    """The hand-over loops in the workflow until done; this bounds it, so a stuck volume ends in FAILED."""
    if not record.interrupted_at:
        return
    elapsed = (deps.now() - parse_time(record.interrupted_at)).total_seconds()
    if elapsed > deps.settings.ebs_handover_s:
        raise HandOverTimedOut(
            f"job {record.job_id}: volume {volume_id} ({state}) has not reached backup "
            f"{record.backup_instance_id} {elapsed:.0f} s after the interruption"
        )


def restore(deps: Deps, job_id: str, generation: int, attempt: str, token: str) -> dict[str, Any]:
    """Order the restore on the backup and wait (task token) for SSM's answer (on_restore_command, or
    check_restore when the wait times out). The command's id is kept per attempt in the record."""
    record = _current(deps, job_id, generation)
    backup_instance_id = record.backup_instance_id
    if backup_instance_id is None:
        raise ValueError(f"job {job_id} has no backup instance to restore on")
    # A final dump whose answer never arrived is read from SSM first: restored if committed, known if it failed,
    # and the job's end if the order found it ended there.
    record = checkpoints.settle_final_dump(deps, record)
    if record.status != Status.RECOVERING:
        raise StaleGeneration(f"job {job_id} is {record.status.value} before its restore was ordered")
    if record.node_count:
        record = _take_over_nodes(deps, record)
    else:
        _retire_primary(deps, record)
    # Then close the generation to the interrupted instance: a final dump that outlived its wait is never recorded
    # after this, so the checkpoint chosen below stays the job's newest until the backup commits its own.
    closed = deps.registry.close_generation(job_id, generation, deps.iso_now())
    if closed is None:
        raise StaleGeneration(f"job {job_id} moved on before its restore was ordered")
    record = closed
    # The agent walks back from this one through every older committed checkpoint; with none it restarts the job
    # from the beginning (unless its tags turn that off). A second attempt starts the walk one checkpoint back.
    checkpoint_id = record.checkpoint_id if attempt == "newest" else record.previous_checkpoint_id
    # Token first, then the command: the agent's answer always finds the token (or the token finds the answer).
    rendezvous.wait_for(deps, job_id, restore_key(attempt), generation, token)
    values = {
        "JobId": job_id,
        "Generation": str(generation),
        "CheckpointId": checkpoint_id or "",
        "RunId": record.run_id,
        "Attempt": attempt,
        "Sequence": str(record.dump_sequence),  # minted by close_generation: the backup ranks after the primary
    }
    target = restore_target(record)
    command_id = deps.cloud.send_command(deps.settings.restore_document, commands.RESTORE, target, values)
    ordered = {"command_id": command_id, "instance_id": target, "generation": generation}
    deps.registry.record_restore_order(
        job_id, generation, restore_command_attribute(attempt), {**ordered, "ordered_at": deps.iso_now()}
    )
    logger.info("restore ordered", job_id=job_id, instance_id=target, checkpoint_id=checkpoint_id)
    return {"checkpoint_id": checkpoint_id, "command_id": command_id}


def restore_target(record: JobRecord) -> str:
    """The instance the restore is ordered to: the backup; for a job over several VMs the one that holds node 0 by
    then (its backup, when node 0 is one of the nodes recovered), whose agent restores every node's part."""
    if record.node_count:
        return record.node_0_instance()
    return str(record.backup_instance_id)


def _take_over_nodes(deps: Deps, record: JobRecord) -> JobRecord:
    """A job over several VMs: the recovered node and each node lost during this recovery, once every lost node has
    a backup that reported ready (NodeWithoutBackup, NodeBackupNotReady: the workflow launches, then retries; a
    backup whose boot failed fails the recovery). Each node's interrupted instance is retired (rule 8) and its
    address moves to its backup; every node is tried before a primary address that must wait for its instance's
    termination is retried (PrimaryStillRunning), so that the instances terminate together. A node's EBS volume
    moves before its address: the record names the backup as the node's only once both are there."""
    _check_lost_backups(record)
    moves = {index: (lost.instance_id, lost.backup) for index, lost in record.lost_nodes.items()}
    if record.interrupted_node is not None and record.recovering_from and record.backup_instance_id:
        moves[record.interrupted_node] = (record.recovering_from, record.backup_instance_id)
    waiting = []
    for index, (interrupted, backup) in sorted(moves.items()):
        if record.node(index).instance_id == backup:
            continue  # moved by an earlier try of this step
        try:
            held = _retire(deps, record, interrupted) if interrupted != backup else None
            if record.node(index).volume_id:
                _take_over_volume(deps, record, index, backup)
            record = _take_over_address(deps, record, index, backup, held)
        except PrimaryStillRunning as error:
            waiting.append(str(error))
    if waiting:
        raise PrimaryStillRunning("; ".join(waiting)[:1000])
    return record


def _check_lost_backups(record: JobRecord) -> None:
    for index, lost in record.lost_nodes.items():
        if not lost.backup:
            raise NodeWithoutBackup(f"job {record.job_id}: node {index}, lost during the recovery, has no backup yet")
        report = record.arrival(early_ready_key(lost.backup))  # by instance: kept whenever it came (note_ready)
        if report is None:
            raise NodeBackupNotReady(f"job {record.job_id}: node {index}'s backup {lost.backup} is not ready yet")
        if report.get("error"):
            raise LaunchFailed(f"node {index}'s backup {lost.backup} failed to boot: {report.get('cause')}"[:1000])


def _take_over_volume(deps: Deps, record: JobRecord, index: int, backup_instance_id: str) -> None:
    """The node's EBS volume goes to its backup once its interrupted instance let it go: EC2 detaches a data volume
    when the instance is terminated (rule 8 holds by then), so it is never attached twice nor detached while its
    file system is mounted. Same AZ: the backup is in the job's subnet. Repeated, it changes nothing."""
    volume_id = record.node(index).volume_id
    volume = deps.cloud.volume(volume_id)
    if volume is None:
        raise RestoreFailed(f"job {record.job_id}: node {index}'s volume {volume_id} does not exist")
    holders = [a["InstanceId"] for a in volume.get("Attachments", []) if a.get("State") in ("attaching", "attached")]
    if backup_instance_id in holders:
        return
    if volume["State"] != "available":
        holder = f"attached to {', '.join(holders)}" if holders else volume["State"]
        raise PrimaryStillRunning(
            f"job {record.job_id}: node {index}'s volume {volume_id} is {holder}; it moves once that is over"
        )
    deps.cloud.attach_volume(volume_id, backup_instance_id)
    logger.info("node volume moved", job_id=record.job_id, node=index, volume_id=volume_id, to=backup_instance_id)


def _take_over_address(
    deps: Deps, record: JobRecord, index: int, backup_instance_id: str, held: Instance | None
) -> JobRecord:
    """Rule 8 holds for the node's interrupted instance: its address moves to the backup (within the job's subnet),
    and the record names the backup as the node's before the restore is ordered. `held`: the interrupted instance
    as _retire last described it. Repeated for a second attempt, it changes nothing."""
    address = record.node(index).address
    if held is not None and held.state != "terminated" and held.private_ips[:1] == (address,):
        # A primary address never moves: it is free once its instance is terminated (the workflow retries).
        raise PrimaryStillRunning(
            f"job {record.job_id}: node {index}'s address {address} is the primary one of {held.instance_id}, "
            f"which is {held.state}; it moves once that instance is terminated"
        )
    backup = deps.cloud.describe_instance(backup_instance_id)
    if backup is None or not backup.interface_id:
        raise RestoreFailed(f"job {record.job_id}: backup {backup_instance_id} has no network interface")
    if address not in backup.private_ips:
        try:
            deps.cloud.move_private_address(backup.interface_id, address)
        except ClientError as error:
            if held is None or held.private_ips[:1] != (address,) or not _in_use(error):
                raise
            # EC2 frees a terminated instance's primary address with its interface, which may lag its state.
            raise PrimaryStillRunning(
                f"job {record.job_id}: node {index}'s address {address} is still held by the interface of "
                f"{held.instance_id} ({held.state}): {error_code(error)}"
            ) from error
        logger.info("node address moved", job_id=record.job_id, node=index, address=address, to=backup_instance_id)
    move = deps.registry.move_lost_node if index in record.lost_nodes else deps.registry.move_node
    moved = move(record.job_id, record.generation, index, backup_instance_id, deps.iso_now())
    if moved is None:
        raise StaleGeneration(f"job {record.job_id} moved on before node {index}'s address moved")
    return moved


def _in_use(error: ClientError) -> bool:
    """EC2's answer for an address another interface holds (InvalidIPAddress.InUse, "Address ... is in use")."""
    code = error_code(error)
    return code == "InvalidIPAddress.InUse" or (code == "InvalidParameterValue" and "in use" in str(error))


_GONE = frozenset({"stopping", "stopped", "shutting-down", "terminated"})


class RestoreFailed(Exception):
    """SSM says the restore command failed on the backup (or never reached it): the workflow tries the previous
    checkpoint, then gives up."""


class RestoreTimedOut(Exception):
    """The restore command still runs on the backup after twice the restore wait: the workflow gives up."""


class BackupNotReady(Exception):
    """The backup reported neither ready nor a failed boot within the readiness wait: the workflow gives up."""


def check_backup_ready(deps: Deps, job_id: str, generation: int) -> dict[str, Any]:
    """The readiness wait timed out. The backup's report may have arrived with only its answer to the wait lost (the
    SendTaskSuccess throttled past every retry in a wave, after the report was recorded): the arrival the record
    keeps decides, as the report would have. Only with none did the backup never report."""
    record = _current(deps, job_id, generation)
    arrival = record.arrival("backup-ready")
    if arrival and arrival.get("generation") == generation:
        if arrival.get("error"):
            raise BackupNotReady(f"{arrival['error']}: {arrival.get('cause') or ''}")
        logger.warning("the backup's ready report arrived but its answer to the wait was lost", job_id=job_id)
        return dict(arrival.get("output") or {})
    wait_s = deps.settings.backup_ready_wait_s
    raise BackupNotReady(f"job {job_id}: backup {record.backup_instance_id} reported nothing within {wait_s} s")


def restore_command_attribute(attempt: str) -> str:
    """Where the record keeps the restore command each attempt sent (its CommandId, instance, generation)."""
    return "command_" + restore_key(attempt).replace("-", "_")


def on_restore_command(deps: Deps, command_id: str, instance_id: str, document_name: str) -> dict[str, Any]:
    """SSM's status-change event for a restore command (source aws.ssm, which no VM can put): take the restore's
    outcome from GetCommandInvocation of that command on that instance and resume the waiting Restore step.

    Invariant (facts from authenticated sources): a restore completes or fails only on what SSM reports for a
    restore command on the job's backup: the instance must be the record's backup, the command the one the step
    sent (or its output must name this job's run, generation and attempt). The agent's RestoreCompleted and
    RestoreFailed events move nothing (tests/workflow/test_authenticated.py)."""
    if document_name != deps.settings.restore_document:
        return {"action": "ignored", "reason": f"not the restore document: {document_name}"}
    record = jobs.record_tagged_on(deps, instance_id)
    if record is None or record.status != Status.RECOVERING or restore_target(record) != instance_id:
        logger.info("restore command of an instance that is no job's backup", instance_id=instance_id)
        return {"action": "ignored", "reason": "not a recovering job's backup"}
    invocation = deps.cloud.command_invocation(command_id, instance_id) or {}
    attempt = _attempt_of(record, command_id, instance_id, invocation)
    if attempt is None:
        logger.warning("restore command answers no attempt of this generation", job_id=record.job_id)
        return {"action": "ignored", "reason": "not this generation's restore"}
    state = _take_restore_result(deps, record, attempt, invocation)
    return {"action": f"restore-{state}", "job_id": record.job_id, "attempt": attempt}


def _attempt_of(record: JobRecord, command_id: str, instance_id: str, invocation: dict[str, Any]) -> str | None:
    """The attempt this command is: the one whose stored CommandId it is, or (the event came before the step stored
    it) the attempt its output names, for this run and generation."""
    for attempt in commands.RESTORE_ATTEMPTS:
        ordered = record.extra.get(restore_command_attribute(attempt))
        if isinstance(ordered, dict) and ordered.get("command_id") == command_id:
            same = ordered.get("instance_id") == instance_id and ordered.get("generation") == record.generation
            return attempt if same else None
    result = agent_events.command_result(invocation, results.parse_restore)
    if isinstance(result, results.RestoreResult) and result.attempt and _answers(result, record, result.attempt):
        return result.attempt
    return None


def _answers(result: results.RestoreResult, record: JobRecord, attempt: str) -> bool:
    """Whether the restore's result names this job's run, generation and that attempt."""
    return (result.job_id, result.run_id, result.generation, result.attempt) == (
        record.job_id,
        record.run_id,
        record.generation,
        attempt,
    )


def _take_restore_result(deps: Deps, record: JobRecord, attempt: str, invocation: dict[str, Any]) -> str:
    """Record SSM's answer to a finished restore command and resume the step; "running" while it still runs."""
    status = str(invocation.get("Status") or "Undeliverable")
    if status in commands.COMMAND_RUNNING:
        return "running"
    key = restore_key(attempt)
    result = agent_events.command_result(invocation, results.parse_restore)
    mine = isinstance(result, results.RestoreResult) and _answers(result, record, attempt)
    if status == commands.COMMAND_SUCCEEDED and isinstance(result, results.RestoreResult) and result.ok and mine:
        output = {
            "checkpoint_id": result.checkpoint_id,
            "instance_id": record.backup_instance_id,
            "pid": result.pid,
            "skipped": result.skipped,
        }
        deps.metric(Metric.RESTORE_SECONDS, "Seconds", result.seconds)
        rendezvous.arrive(deps, record.job_id, key, record.generation, output)
        return "restored"
    if status == commands.COMMAND_SUCCEEDED:
        cause = "the restore command succeeded but printed no result for this job's run, generation and attempt"
    elif result is not None and result.error:
        cause = result.error[:1000]
    else:
        stderr = str(invocation.get("StandardErrorContent") or "").strip()
        cause = f"the restore command ended {status} on {record.backup_instance_id}" + (
            f": {stderr[-500:]}" if stderr else ""
        )
    rendezvous.arrive(deps, record.job_id, key, record.generation, {}, error="RestoreFailed", cause=cause)
    return "failed"


def check_restore(deps: Deps, job_id: str, generation: int, attempt: str) -> dict[str, Any]:
    """The Restore step timed out (its status-change event was lost, or the restore runs long): ask SSM.

    Invariant (a lost answer never terminates a healthy backup): a restore SSM reports done is taken; one it
    reports still running is waited for (the workflow polls) until twice the restore wait since it was ordered;
    only a command SSM reports failed or undeliverable, or a backup that is gone, fails the attempt
    (tests/workflow/test_authenticated.py)."""
    record = _current(deps, job_id, generation)
    key = restore_key(attempt)
    arrival = record.arrival(key)
    if arrival and arrival.get("generation") == generation:
        if arrival.get("error"):
            raise RestoreFailed(str(arrival.get("cause") or arrival["error"]))
        return {"restored": True}
    ordered = record.extra.get(restore_command_attribute(attempt))
    if not isinstance(ordered, dict) or ordered.get("generation") != generation:
        raise RestoreFailed(f"job {job_id}: no restore command was sent for attempt {attempt}")
    instance_id = str(ordered["instance_id"])
    backup = deps.cloud.describe_instance(instance_id)
    if backup is None or backup.state in _GONE:
        raise RestoreFailed(f"job {job_id}: backup {instance_id} is {backup.state if backup else 'gone'}")
    invocation = deps.cloud.command_invocation(str(ordered["command_id"]), instance_id)
    if invocation is None:
        invocation = {"Status": "Undeliverable"}
    state = _take_restore_result(deps, record, attempt, invocation)
    if state == "restored":
        return {"restored": True}
    if state == "failed":
        fresh = _current(deps, job_id, generation).arrival(key) or {}
        raise RestoreFailed(str(fresh.get("cause") or "the restore command failed"))
    waited = (deps.now() - parse_time(str(ordered["ordered_at"]))).total_seconds()
    if waited > 2 * deps.settings.restore_wait_s:
        raise RestoreTimedOut(f"job {job_id}: the restore on {instance_id} still runs after {waited:.0f} s")
    logger.info("restore still running; waiting", job_id=job_id, attempt=attempt, waited_s=round(waited))
    return {"restored": False}


def _retire_primary(deps: Deps, record: JobRecord) -> Instance | None:
    """The job never runs in two places: before the backup restores, the interrupted instance is terminated and its
    persistent spot request cancelled, so a stopped or hibernated primary that EC2 starts again later cannot resume
    the job (hibernation resumes its processes from RAM before any agent could fence them).

    One live copy (spotcr_contracts.protocol, rule 8): the restore waits (PrimaryStillRunning, retried by the
    workflow) until EC2 says the primary is gone, unless nothing of the job can run there. Returns the instance as
    last described (None when there is none to retire), so the caller need not ask EC2 again."""
    instance_id = record.recovering_from
    if not instance_id or instance_id == record.backup_instance_id:
        return None
    return _retire(deps, record, instance_id)


def _retire(deps: Deps, record: JobRecord, instance_id: str) -> Instance | None:
    """_retire_primary for one instance the job recovers from (a lost node's too)."""
    instance = deps.cloud.describe_instance(instance_id)
    if instance is None or instance.state == "terminated":
        return instance
    if instance.spot_request_id:
        deps.cloud.cancel_spot_request(instance.spot_request_id)
    deps.cloud.terminate_instance(instance_id)
    logger.info("interrupted instance terminated", job_id=record.job_id, instance_id=instance_id, was=instance.state)
    gone = job_gone_from(record, instance.instance_id) and not restarted(record, instance.launched_at)
    if instance.state in NOT_RUNNING_STATES or gone:
        return instance
    after = deps.cloud.describe_instance(instance_id)
    if after is not None and after.state != "terminated":
        raise PrimaryStillRunning(f"job {record.job_id}: interrupted instance {instance_id} is {after.state}")
    return after


def finish(deps: Deps, job_id: str, generation: int) -> dict[str, Any]:
    """The backup is the job's current instance now; the job runs again at the new generation."""
    record = _current(deps, job_id, generation)
    if record.backup_instance_id is None or record.backup_az is None:
        raise ValueError(f"job {job_id} has no backup to finish on")
    backup = deps.cloud.describe_instance(record.backup_instance_id)
    answers = [record.arrival(key) or {} for key in reversed(RESTORE_KEYS)]  # the last attempt's answer first
    restored = next((a.get("output") or {} for a in answers if a and not a.get("error")), {})
    # The job's instance is the one the restore was ordered to: the backup, or node 0's for a job over several VMs.
    instance_id = restore_target(record)
    values: dict[str, Any] = {
        "instance_id": instance_id,
        "az": record.backup_az,  # one subnet for every node of a job over several VMs
        "next_checkpoint_at": deps.unix_now() + record.interval_s,
        "updated_at": deps.iso_now(),
    }
    if backup is not None and instance_id == backup.instance_id:
        values |= {"subnet_id": backup.subnet_id, "instance_type": backup.instance_type, "image_id": backup.image_id}
    if record.handover_volume_id:
        values["volume_id"] = record.handover_volume_id
    updated = deps.registry.finish_recovery(job_id, generation, values, backup=record.backup_instance_id, seen=record)
    if updated is None:
        raise StaleGeneration(f"job {job_id} moved on before its recovery finished")
    if record.handover_volume_id and record.volume_id and record.handover_volume_id != record.volume_id:
        _delete_replaced(deps, job_id, record.volume_id, record.handover_snapshot_id)
    now = deps.now()
    if record.interrupted_at:
        warned = parse_time(record.interrupted_at)
        deps.metric(Metric.RECOVERY_SECONDS, "Seconds", (now - warned).total_seconds())
        checkpoint_id = str(restored.get("checkpoint_id") or "")
        if checkpoint_id.endswith("-periodic"):
            taken = checkpoint_time(checkpoint_id)
            deps.metric(Metric.LOST_WORK_SECONDS, "Seconds", max((warned - taken).total_seconds(), 0.0))
    deps.metric(Metric.RECOVERIES_SUCCEEDED, "Count", 1)
    logger.info("job recovered", job_id=job_id, generation=generation, instance_id=record.backup_instance_id)
    if restored and not restored.get("checkpoint_id"):
        why = restored.get("skipped") or "no committed checkpoint"
        message = f"spotcr job {job_id} restarted from the beginning on {record.backup_instance_id}: {why}"
        deps.cloud.notify(deps.settings.failure_topic_arn, f"spotcr job {job_id} restarted", message[:4000])
    return {"job_id": job_id, "generation": generation, "instance_id": record.backup_instance_id}


def _delete_replaced(deps: Deps, job_id: str, volume_id: str, snapshot_id: str | None) -> None:
    """The new volume is committed as the job's: the volume it replaced and the snapshot that carried it go."""
    if snapshot_id:
        deps.cloud.delete_snapshot(snapshot_id)
    if not deps.cloud.delete_volume(volume_id):
        logger.warning("replaced volume still attached; not deleted", job_id=job_id, volume_id=volume_id)
    logger.info("replaced volume and snapshot deleted", job_id=job_id, volume_id=volume_id, snapshot_id=snapshot_id)


def fail(deps: Deps, job_id: str, generation: int, error: str, cause: str) -> dict[str, Any]:
    """Recovery gave up: the job is FAILED, its backup (if any) terminated; the workflow then notifies.

    Only a job still RECOVERING this generation is failed: one that ended meanwhile keeps its own end."""
    record = deps.registry.get(job_id)
    detail = readable_cause(cause)
    reason = f"recovery of generation {generation} failed: {error}{': ' + detail if detail else ''}"[:1024]
    updated = deps.registry.fail_recovery(job_id, generation, reason, deps.iso_now())
    if updated is None:
        logger.info("recovery failed for a superseded generation", job_id=job_id, generation=generation)
        return {"job_id": job_id, "marked_failed": False, "message": f"spotcr job {job_id}: {reason}"}
    efs_access.close_for(deps, updated)
    if record:
        _tidy_failed(deps, record)
    for backup in record.backups() if record else ():
        deps.cloud.terminate_instance(backup)
    if record and record.node_count:  # the other nodes wait locked for a restore that never comes
        gone = (record.recovering_from, *record.backups())
        jobs.retire(deps, [n.instance_id for n in record.nodes if n.instance_id not in gone], reason)
    deps.metric(Metric.RECOVERIES_FAILED, "Count", 1)
    logger.error("job failed", job_id=job_id, generation=generation, reason=reason)
    return {"job_id": job_id, "marked_failed": True, "message": f"spotcr job {job_id}: {reason}"}


def readable_cause(cause: str) -> str:
    """A Lambda error's cause is a JSON document with a stack trace: keep its type and message, never the trace."""
    try:
        document = json.loads(cause)
    except ValueError:
        return cause[:500]
    if isinstance(document, dict) and "errorMessage" in document:
        kind = str(document.get("errorType") or "Error")
        return f"{kind}: {document['errorMessage']}"[:500]
    return cause[:500]


def _tidy_failed(deps: Deps, record: JobRecord) -> None:
    """A failed recovery leaves the job's checkpoints (on the original volume for EBS) and nothing else."""
    if record.handover_snapshot_id:
        deps.cloud.delete_snapshot(record.handover_snapshot_id)
    if record.handover_volume_id and record.handover_volume_id != record.volume_id:
        _delete_volume_now(deps, record.handover_volume_id)
    try:
        _retire_primary(deps, record)
    except PrimaryStillRunning:
        logger.info("interrupted instance is terminating", instance_id=record.recovering_from)


def _delete_volume_now(deps: Deps, volume_id: str) -> None:
    """Detach (from the backup, about to be terminated) and delete a volume the failed hand-over created."""
    volume = deps.cloud.volume(volume_id)
    if volume is None:
        return
    attachments = [a for a in volume.get("Attachments", []) if a.get("State") in ("attaching", "attached")]
    for attachment in attachments:
        deps.cloud.detach_volume(volume_id, attachment["InstanceId"])
    if attachments:
        deps.cloud.wait_volume_available(volume_id)
    if not deps.cloud.delete_volume(volume_id):
        logger.warning("hand-over volume still attached; not deleted", volume_id=volume_id)


def on_recovery_ended(
    deps: Deps, state_machine_arn: str, execution: str, status: str, execution_input: str | None
) -> dict[str, Any]:
    """A recovery that timed out, was aborted, or failed past its Catch (States.Runtime, States.DataLimitExceeded,
    or MarkFailed itself failing) leaves the job RECOVERING: fail it, terminate its backup, notify."""
    if state_machine_arn != deps.settings.recovery_state_machine_arn:
        return {"action": "ignored", "reason": "not this stack's recovery state machine"}
    if status not in ("FAILED", "TIMED_OUT", "ABORTED"):
        return {"action": "ignored", "reason": f"execution {status}"}
    try:
        payload = json.loads(execution_input or "")
        job_id, generation = str(payload["job_id"]), int(payload["generation"])
    except (ValueError, KeyError, TypeError):
        return {"action": "ignored", "reason": "not a spotcr recovery"}
    record = deps.registry.get(job_id)
    if record is None or record.status != Status.RECOVERING or record.generation != generation:
        return {"action": "ignored", "reason": "the job is not recovering this generation"}
    result = fail(deps, job_id, generation, f"Execution{status.title().replace('_', '')}", f"{execution} {status}")
    if result["marked_failed"]:
        deps.cloud.notify(deps.settings.failure_topic_arn, f"spotcr job {job_id} failed", result["message"])
    return {"action": "failed" if result["marked_failed"] else "ignored", **result}


def checkpoint_time(checkpoint_id: str) -> datetime:
    """Checkpoint ids start with the unix milliseconds they were taken at."""
    return datetime.fromtimestamp(int(checkpoint_id.split("-", 1)[0]) / 1000, UTC)


def on_backup_down(deps: Deps, instance_id: str, at: str, *, reason: str, final_dump: bool) -> dict[str, Any]:
    """A backup interrupted or gone while its recovery still runs starts a new cycle from the newest checkpoint.

    Backups are first-class: the instance is found by its spotcr:job tag (the job's current instance is still
    the old primary until Finish), the generation is bumped from the recovering one, the old workflow's waits
    are released, and a warning orders the backup's own final dump: its agent takes it as soon as it runs the job.
    """
    record = jobs.record_tagged_on(deps, instance_id)
    if record is not None and record.node_count and (record.node_of(instance_id) or instance_id in record.backups()):
        return _node_interrupted(deps, record, instance_id, at, reason=reason, final_dump=final_dump)
    if record is None or instance_id not in (record.backup_instance_id, record.recovering_from):
        logger.info("instance event for an instance that runs no job", instance_id=instance_id, reason=reason)
        return {"action": "ignored", "reason": "no job on this instance"}
    if record.backup_instance_id != instance_id:
        return _already_recovering(deps, record.job_id, instance_id)
    return _backup_lost(deps, record, instance_id, at, reason=reason, final_dump=final_dump)


def _backup_lost(
    deps: Deps, record: JobRecord, instance_id: str, at: str, *, reason: str, final_dump: bool
) -> dict[str, Any]:
    """The recorded backup went while it restores: the next generation recovers from it."""
    bumped = deps.registry.bump_backup(record, at, final_dump=final_dump)
    if bumped is None:
        return _already_recovering(deps, record.job_id, instance_id)
    for key in WAIT_KEYS:
        token = record.token(key)
        if token and token.get("generation") == record.generation:
            deps.cloud.complete_task(str(token["token"]), {}, error="StaleGeneration", cause=f"backup lost: {reason}")
    logger.warning("the backup went away during its recovery; a new cycle starts", job_id=record.job_id, reason=reason)
    if final_dump:
        _recover_with_final_dump(deps, bumped, instance_id, reason=f"backup-{reason}")
    else:
        _start(deps, bumped, instance_id, reason=f"backup-{reason}", final_dump=False)
    return {"action": "recovering", "job_id": bumped.job_id, "generation": bumped.generation, "final_dump": final_dump}
