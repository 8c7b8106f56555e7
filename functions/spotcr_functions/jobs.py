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

from spotcr_functions import efs_access
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

    record = JobRecord(
        job_id=spec.job_id,
        status=Status.PENDING,
        generation=spec.generation,
        instance_id=instance_id,
        az=instance.az,
        subnet_id=instance.subnet_id,
        vpc_id=instance.vpc_id,
        instance_type=instance.instance_type,
        image_id=instance.image_id,
        storage=spec.storage,
        interval_s=spec.interval_s,
        tags={k: v for k, v in spec.to_tags().items() if k != tags.RUN},  # spotcr mints the run, never the user
        fallback_types=spec.fallback_types,
        run_id=tags.new_run_id(),
        next_checkpoint_at=_start_deadline(deps),
        updated_at=deps.iso_now(),
    )
    registered = deps.registry.register(record)
    if registered.instance_id != instance_id:
        return _reject(deps, instance_id, f"{tags.JOB}: job {spec.job_id} already runs on {registered.instance_id}")
    tag_run(deps, registered, instance.tags)
    if spec.storage == "ebs" and registered.volume_id is None:
        registered = _create_job_volume(deps, registered)
    registered = efs_access.open_for(deps, registered)
    logger.info("job registered", job_id=spec.job_id, instance_id=instance_id, storage=spec.storage)
    return {"registered": True, "job_id": spec.job_id, "volume_id": registered.volume_id}


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
    reason = (
        f"the job did not start within {minutes} minutes on {record.instance_id} (pending_timeout_minutes): "
        "check the instance's console output (aws ec2 get-console-output) and its user data log "
        "(/var/log/cloud-init-output.log)"
    )
    ended = deps.registry.end(record, Status.FAILED, {"reason": reason, "updated_at": deps.iso_now()})
    if ended is None:
        return False
    logger.error("job never started", job_id=record.job_id, instance_id=record.instance_id, minutes=minutes)
    efs_access.close_for(deps, ended)
    instance = deps.cloud.describe_instance(record.instance_id)
    if instance is not None and instance.state not in ("shutting-down", "terminated"):
        deps.cloud.tag_instance(record.instance_id, {tags.ERROR: reason[: tags.MAX_TAG_VALUE]})
        # A user's own instance submitted by tag is only marked: spotcr terminates only what it launched.
        if instance.tags.get(tags.LAUNCH_TEMPLATE) == deps.settings.launch_template_id:
            deps.cloud.terminate_instance(record.instance_id)
    deps.cloud.notify(deps.settings.failure_topic_arn, f"spotcr job {record.job_id} failed", reason)
    return True


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
        if instance_id in (record.backup_instance_id, record.instance_id, record.recovering_from):
            return {"registered": False, "reason": "backup launched by spotcr"}
        launching = record.status == Status.RECOVERING and record.backup_instance_id is None
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
    volume_id = deps.cloud.create_volume(
        az=record.az,
        size_gib=deps.settings.ebs_volume_gib,
        tags={tags.JOB: record.job_id, tags.STACK: deps.settings.stack_name},
        client_token=client_token(record.job_id, record.instance_id),
    )
    deps.cloud.wait_volume_available(volume_id)
    deps.cloud.attach_volume(volume_id, record.instance_id)
    updated = deps.registry.record_volume(record.job_id, record.instance_id, volume_id)
    return updated or record
