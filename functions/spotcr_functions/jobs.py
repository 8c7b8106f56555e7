"""Submit by tagging: register a job from a running instance's tags, or tag the instance with why it cannot run.

One identity per run: registering mints the run's id (`spotcr:run`) and tags the registered instance with it. An
agent in run mode starts the job only once that tag is on its instance, so an instance refused (the name already
runs elsewhere: PENDING, RUNNING, CHECKPOINTING or RECOVERING) gets `spotcr:error` and never starts the job. A name
reused after COMPLETED or FAILED is a new run with a new id: its checkpoints live apart from the earlier run's
(the store is keyed by run), and the earlier run's events and commands are refused by both sides.

Tags a user writes are never taken for spotcr's: an instance tagged `spotcr:mode=restore` is a backup only if the
job's record names it as one for this run (the recovery records it at launch); any other gets `spotcr:error`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aws_lambda_powertools import Logger
from spotcr_contracts import tags
from spotcr_contracts.names import client_token
from spotcr_contracts.nodes import NodeRecord, new_launch_key

from spotcr_functions import efs_access
from spotcr_functions.cloud import Instance
from spotcr_functions.deps import Deps
from spotcr_functions.models import JobRecord, Status
from spotcr_functions.observability import SERVICE

logger = Logger(service=SERVICE, child=True)


def record_tagged_on(deps: Deps, instance_id: str) -> JobRecord | None:
    """The record of the job the instance is tagged with (spotcr:job), whichever role it plays for that job (its
    instance, its backup, the interrupted one): None when the instance is gone, untagged or its job unknown."""
    instance = deps.cloud.describe_instance(instance_id)
    job_id = instance.tags.get(tags.JOB) if instance else None
    return deps.registry.get(job_id) if job_id else None


def register_instance(deps: Deps, instance_id: str) -> dict[str, Any]:  # noqa: PLR0911 (guard clauses)
    instance = deps.cloud.describe_instance(instance_id)
    if instance is None:
        logger.info("instance not found; nothing to register", instance_id=instance_id)
        return {"registered": False, "reason": "instance not found"}
    if not tags.is_job(instance.tags):
        logger.debug("not a spotcr job", instance_id=instance_id)
        return {"registered": False, "reason": "not a job"}
    if instance.state != "running":
        logger.info("job instance is not running yet", instance_id=instance_id, state=instance.state)
        return {"registered": False, "reason": f"instance is {instance.state}"}
    if tags.launched_by_spotcr(instance.tags):
        return _confirm_backup(deps, instance_id, instance.tags)
    try:
        spec = tags.parse_job_tags(instance.tags)
    except tags.InvalidJobTags as error:
        return _reject(deps, instance_id, str(error))

    if spec.nodes > 1:
        return _register_node(deps, instance, spec)
    registered = deps.registry.register(_pending(deps, instance, spec))
    if registered.instance_id != instance_id:
        return _reject(deps, instance_id, f"{tags.JOB}: job {spec.job_id} already runs on {registered.instance_id}")
    tag_run(deps, registered, instance.tags)
    if spec.storage == "ebs" and registered.volume_id is None:
        registered = _create_job_volume(deps, registered)
    registered = efs_access.open_for(deps, registered)
    logger.info("job registered", job_id=spec.job_id, instance_id=instance_id, storage=spec.storage)
    return {"registered": True, "job_id": spec.job_id, "volume_id": registered.volume_id}


def node_address(instance: Instance) -> str:
    """A node's address: its primary private address, the one MPI listens on and names to the other nodes (MPICH's
    ranks take the interface's first address, whatever else it holds). It moves to a backup once its instance is
    terminated (EC2 frees it with the instance's interface), as a secondary address there (docs/design/multinode.md:
    a secondary node address left the ranks' listeners on an address that never moves)."""
    return instance.private_ips[0]


def _register_node(deps: Deps, instance: Instance, spec: tags.JobSpec) -> dict[str, Any]:
    """One node of a job over several VMs: the first to register puts the job's record and mints its run and launch
    key; each other node joins that run (Registry.join_node) if its tags are the same job's and it is in the same
    subnet. Each node gets the run's tag once it is in the record; the agents start only once every node is."""
    if not instance.private_ips:
        return _reject(deps, instance.instance_id, f"{tags.NODE}: {instance.instance_id} has no private address")
    node = NodeRecord(spec.node_index, instance.instance_id, node_address(instance))
    first = _pending(deps, instance, spec, node_count=spec.nodes, nodes=(node,), launch_key=new_launch_key())
    registered = deps.registry.register(first)
    held = registered.node_of(instance.instance_id)  # a duplicate event finds the node (with its volume) in place
    if registered.run_id != first.run_id and (held is None or (held.index, held.address) != (node.index, node.address)):
        if problem := _join_problem(registered, spec, instance):
            return _reject(deps, instance.instance_id, problem)
        coordinator = {"instance_type": instance.instance_type, "image_id": instance.image_id}
        joined = deps.registry.join_node(registered, node, deps.iso_now(), coordinator)
        if joined is None:
            current = deps.registry.get(spec.job_id) or registered
            return _reject(deps, instance.instance_id, _join_problem(current, spec, instance) or "the job moved on")
        registered = joined
    if spec.storage == "ebs" and not registered.node(spec.node_index).volume_id:
        registered = _create_node_volume(deps, registered, registered.node(spec.node_index))
    deps.cloud.tag_instance(instance.instance_id, {tags.RUN: registered.run_id})
    registered = efs_access.open_for(deps, registered)
    logger.info("node registered", job_id=spec.job_id, instance_id=instance.instance_id, node=spec.node_index)
    return {"registered": True, "job_id": spec.job_id, "node": spec.node_index, "nodes": len(registered.nodes)}


def _pending(deps: Deps, instance: Instance, spec: tags.JobSpec, **values: Any) -> JobRecord:
    """A new run of the job on this instance, PENDING until it starts, with a run id minted here (`values`: a job
    over several VMs' nodes)."""
    return JobRecord(
        job_id=spec.job_id,
        status=Status.PENDING,
        generation=spec.generation,
        instance_id=instance.instance_id,
        az=instance.az,
        subnet_id=instance.subnet_id,
        vpc_id=instance.vpc_id,
        instance_type=instance.instance_type,
        image_id=instance.image_id,
        storage=spec.storage,
        interval_s=spec.interval_s,
        tags=_job_tags(spec),
        fallback_types=spec.fallback_types,
        run_id=tags.new_run_id(),
        next_checkpoint_at=_start_deadline(deps),
        updated_at=deps.iso_now(),
        **values,
    )


def _job_tags(spec: tags.JobSpec) -> dict[str, str]:
    """The job's tags as its record keeps them: never the run (spotcr mints it) nor one node's index."""
    return {k: v for k, v in spec.to_tags().items() if k not in (tags.RUN, *tags.PER_NODE_TAGS)}


def _join_problem(record: JobRecord, spec: tags.JobSpec, instance: Instance) -> str | None:
    """Why this node cannot join the registered record (None: it may)."""
    if record.status != Status.PENDING or record.node_count != spec.nodes:
        return f"{tags.JOB}: job {spec.job_id} already runs on {record.instance_id} ({record.status.value})"
    if problem := tags.same_job(record.tags, _job_tags(spec)):
        return problem
    if instance.subnet_id != record.subnet_id:
        return (
            f"{tags.NODES}: every node of job {spec.job_id} is in subnet {record.subnet_id} (a node's address moves "
            f"only within its subnet); {instance.instance_id} is in {instance.subnet_id}"
        )
    holder = next((n.instance_id for n in record.nodes if n.index == spec.node_index), instance.instance_id)
    if holder != instance.instance_id:
        return f"{tags.NODE}: node {spec.node_index} of job {spec.job_id} is {holder} already"
    return None


def _start_deadline(deps: Deps) -> int | None:
    """A PENDING job's deadline to start by (the scheduler fails it after: time_out_pending); None: never."""
    minutes = deps.settings.pending_timeout_minutes
    return deps.unix_now() + 60 * minutes if minutes else None


def time_out_pending(deps: Deps, record: JobRecord) -> bool:
    """A job still PENDING at its deadline never started: its VM's user data failed before the agent ran (nothing
    reports that on the bus), or the agent never got its run. FAILED with the reason, the instance marked
    spotcr:error and, only if spotcr launched it (from its launch template), terminated; the failure is notified.
    True when this call ended the job (None from the write: it started or ended meanwhile)."""
    minutes = deps.settings.pending_timeout_minutes
    where = record.instance_id
    if record.node_count:
        held = ", ".join(node.instance_id for node in record.nodes)
        where = f"{len(record.nodes)} of its {record.node_count} nodes ({held})"
    reason = (
        f"the job did not start within {minutes} minutes on {where} (pending_timeout_minutes): "
        "check the instance's console output (aws ec2 get-console-output) and its user data log "
        "(/var/log/cloud-init-output.log)"
    )
    ended = deps.registry.end(record, Status.FAILED, {"reason": reason, "updated_at": deps.iso_now()})
    if ended is None:
        return False
    logger.error("job never started", job_id=record.job_id, instance_id=record.instance_id, minutes=minutes)
    efs_access.close_for(deps, ended)
    retire(deps, [node.instance_id for node in record.nodes] or [record.instance_id], reason)
    deps.cloud.notify(deps.settings.failure_topic_arn, f"spotcr job {record.job_id} failed", reason)
    return True


def retire(deps: Deps, instance_ids: list[str], reason: str) -> None:
    """Instances of a job that failed: each still up is marked spotcr:error with the reason and, only if spotcr
    launched it (from its launch template), terminated; a user's own instance submitted by tag is only marked."""
    for instance_id in instance_ids:
        instance = deps.cloud.describe_instance(instance_id)
        if instance is not None and instance.state not in ("shutting-down", "terminated"):
            deps.cloud.tag_instance(instance_id, {tags.ERROR: reason[: tags.MAX_TAG_VALUE]})
            if instance.tags.get(tags.LAUNCH_TEMPLATE) == deps.settings.launch_template_id:
                deps.cloud.terminate_instance(instance_id)


def tag_run(deps: Deps, record: JobRecord, instance_tags: Mapping[str, str] | None = None) -> None:
    """Put the run's id on its registered instance: the agent's signal that this VM may start the job."""
    if record.run_id and (instance_tags or {}).get(tags.RUN) != record.run_id:
        deps.cloud.tag_instance(record.instance_id, {tags.RUN: record.run_id})
        logger.info("run tagged", job_id=record.job_id, instance_id=record.instance_id, run_id=record.run_id)


def _confirm_backup(deps: Deps, instance_id: str, instance_tags: Mapping[str, str]) -> dict[str, Any]:
    """A backup the recovery launched is the job's and the workflow owns it; an instance a user tagged restore is
    refused, or its agent would wait for a restore forever."""
    job_id = instance_tags.get(tags.JOB, "")
    record = deps.registry.get(job_id) if tags.JOB_NAME.fullmatch(job_id) else None
    if record is not None and instance_tags.get(tags.RUN) == record.run_id:
        if instance_id in (*record.backups(), record.instance_id, record.recovering_from):
            return {"registered": False, "reason": "backup launched by spotcr"}
        node = instance_tags.get(tags.NODE, "")
        lost = node.isdigit() and int(node) in record.lost_nodes  # a lost node's backup, recorded right after too
        launching = record.status == Status.RECOVERING and (record.backup_instance_id is None or lost)
        if launching and instance_tags.get(tags.GENERATION) == str(record.generation):
            # The recovery records its backup right after RunInstances returns: no verdict before that.
            return {"registered": False, "reason": "backup of this generation not recorded yet"}
    return _reject(
        deps,
        instance_id,
        f"{tags.MODE}: restore is set by spotcr on the backups it launches; {instance_id} is no backup of job {job_id}",
    )


def _reject(deps: Deps, instance_id: str, reason: str) -> dict[str, Any]:
    logger.warning("job rejected", instance_id=instance_id, reason=reason)
    deps.cloud.tag_instance(instance_id, {tags.ERROR: reason[: tags.MAX_TAG_VALUE]})
    return {"registered": False, "error": reason}


def _create_job_volume(deps: Deps, record: JobRecord) -> JobRecord:
    """The job's encrypted EBS volume, in the instance's AZ; the agent waits for the device to appear."""
    volume_id = _attached_volume(deps, record, record.instance_id)
    updated = deps.registry.record_volume(record.job_id, record.instance_id, volume_id)
    return updated or record


def _create_node_volume(deps: Deps, record: JobRecord, node: NodeRecord) -> JobRecord:
    """A node's own EBS volume (a job over several VMs, one volume per node), in the job's AZ; it holds the node's
    parts of the job's checkpoints (and node 0's the job manifests), and moves with the node's address."""
    volume_id = _attached_volume(deps, record, node.instance_id)
    updated = deps.registry.record_node_volume(record.job_id, node.index, node.instance_id, volume_id)
    return updated or record


def _attached_volume(deps: Deps, record: JobRecord, instance_id: str) -> str:
    """A new encrypted volume of the job's, attached to the instance (one per instance: the client token)."""
    volume_id = deps.cloud.create_volume(
        az=record.az,
        size_gib=deps.settings.ebs_volume_gib,
        tags={tags.JOB: record.job_id, tags.STACK: deps.settings.stack_name},
        client_token=client_token(record.job_id, instance_id),
    )
    deps.cloud.wait_volume_available(volume_id)
    deps.cloud.attach_volume(volume_id, instance_id)
    return volume_id
