"""The commands that change things: submit, restore, interrupt, cancel. Each one goes through the stack's own path."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any

from spotcr_contracts import tags
from spotcr_contracts.commands import checkpoint_order
from spotcr_contracts.layout import is_result_key, job_prefix
from spotcr_contracts.names import client_token, execution_name, execution_prefix
from spotcr_functions.models import ACTIVE, ENDED, JobRecord, Status
from spotcr_functions.registry import Registry

from spotcr_cli import jobs
from spotcr_cli.aws import Cloud, CommandError

Say = Callable[[str], None]


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def job_tags(
    job_id: str,
    *,
    command: str | None,
    spec: str | None,
    storage: str | None,
    interval_s: int | None,
    fallback_types: str | None,
    workdir: str | None,
    tcp: str | None,
    restart_from_scratch: bool | None,
    result: str | None = None,
    lazy_restore: bool | None = None,
    nodes: int | None = None,
) -> dict[str, str]:
    """The tags of a job, checked exactly as the control plane and the agent check them (InvalidJobTags names it).
    A job over several VMs (`nodes`) gets its count, and node 0's index: node_tags gives each node its own."""
    values = {
        tags.JOB: job_id,
        tags.COMMAND: command,
        tags.SPEC: spec,
        tags.STORAGE: storage,
        tags.INTERVAL: None if interval_s is None else str(interval_s),
        tags.FALLBACK_TYPES: fallback_types,
        tags.WORKDIR: workdir,
        tags.TCP: tcp,
        tags.RESTART_FROM_SCRATCH: None if restart_from_scratch is None else str(restart_from_scratch).lower(),
        tags.RESULT: result,
        tags.LAZY_RESTORE: None if lazy_restore is None else str(lazy_restore).lower(),
        tags.NODES: None if nodes is None else str(nodes),
        tags.NODE: None if nodes is None else "0",
    }
    chosen = {key: value for key, value in values.items() if value is not None}
    if command is not None and spec is not None:
        raise tags.InvalidJobTags(tags.COMMAND, f"give {tags.COMMAND} or {tags.SPEC}, not both")
    tags.parse_job_tags(chosen)
    return chosen


def node_tags(job: Mapping[str, str], index: int) -> dict[str, str]:
    """Node `index`'s tags of a job over several VMs: the job's, with its own spotcr:node."""
    return {**job, tags.NODE: str(index)}


def submit(
    cloud: Cloud,
    job: Mapping[str, str],
    *,
    instance_id: str | None,
    instance_type: str | None,
    on_demand: bool,
    say: Say,
) -> dict[str, Any]:
    """Launch an instance from the stack's launch template with the job's tags, or tag a running one launched from
    that template (the stack's grants command and terminate only those).

    The template names no instance type (EC2 would launch an m1.small): a launch needs one."""
    ec2 = cloud.client("ec2")
    tag_list = [{"Key": key, "Value": value} for key, value in job.items()]
    if instance_id is not None:
        found = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
        instance = found[0]["Instances"][0] if found else None
        if instance is None or instance.get("State", {}).get("Name") not in ("pending", "running"):
            raise CommandError(f"instance {instance_id} is not running")
        launched_from = {t["Key"]: t["Value"] for t in instance.get("Tags", [])}.get(tags.LAUNCH_TEMPLATE)
        if launched_from != cloud.stack.launch_template_id:
            raise CommandError(
                f"instance {instance_id} was not launched from the stack's launch template "
                f"{cloud.stack.launch_template_id} ({tags.LAUNCH_TEMPLATE} is {launched_from or 'absent'}): spotcr "
                "may neither command nor terminate it; submit without --instance to launch one from the template"
            )
        ec2.create_tags(Resources=[instance_id], Tags=tag_list)
        say(f"tagged {instance_id}: its bootstrap registers job {job[tags.JOB]}")
        return {"job_id": job[tags.JOB], "instance_id": instance_id, "tags": dict(job)}
    if not instance_type:
        raise CommandError("--instance-type is required to launch: the stack's launch template names none", 2)
    stack = cloud.stack
    template = {"LaunchTemplateId": stack.launch_template_id, "Version": stack.launch_template_version}
    arguments: dict[str, Any] = {
        "LaunchTemplate": template,
        "InstanceType": instance_type,
        "MinCount": 1,
        "MaxCount": 1,
        "TagSpecifications": [{"ResourceType": "instance", "Tags": tag_list}],
        "ClientToken": client_token(job[tags.JOB], uuid.uuid4().hex),
    }
    if not on_demand:
        arguments["InstanceMarketOptions"] = {"MarketType": "spot"}
    if stack.subnets:
        arguments["SubnetId"] = stack.subnets[0]
    launched = ec2.run_instances(**arguments)["Instances"][0]
    say(f"launched {launched['InstanceId']} ({launched.get('InstanceType')}) for job {job[tags.JOB]}")
    return {
        "job_id": job[tags.JOB],
        "instance_id": launched["InstanceId"],
        "instance_type": launched.get("InstanceType"),
        "market": "on-demand" if on_demand else "spot",
        "tags": dict(job),
    }


class _Session:
    """What Registry asks of a boto3 session: a DynamoDB resource at the command's endpoint."""

    def __init__(self, cloud: Cloud) -> None:
        self._cloud = cloud

    def resource(self, service: str, **options: Any) -> Any:
        import boto3

        return boto3.resource(service, region_name=self._cloud.region, endpoint_url=self._cloud.endpoint_url, **options)


def cancel(cloud: Cloud, job_id: str, *, delete_checkpoints: bool, say: Say) -> dict[str, Any]:
    """CANCELLED first (so nothing orders a dump or starts a recovery), then stop its workflow and its VMs."""
    record = jobs.get_record(cloud, job_id)
    was = record.status
    registry = Registry(cloud.stack.job_table, session=_Session(cloud))
    for _ in range(5):
        if record.status in ENDED:
            say(f"job {job_id} is {record.status} already")
            break
        why = {"reason": "cancelled by the user (spotcr cancel)", "updated_at": _now()}
        cancelled = registry.end(record, Status.CANCELLED, why)
        if cancelled is not None:
            say(f"job {job_id} cancelled (was {record.status}, generation {record.generation})")
            record = cancelled
            break
        record = jobs.get_record(cloud, job_id)
    else:
        raise CommandError(f"job {job_id} kept changing; run spotcr cancel again")
    stopped = _stop_recoveries(cloud, job_id, say) if record.status == Status.CANCELLED else []
    terminated = []
    if record.status == Status.CANCELLED:
        for instance in jobs.instances(cloud, job_id):
            if instance.get("State", {}).get("Name") in jobs.RUNNING_STATES:
                terminated.append(instance["InstanceId"])
        if terminated:
            cloud.client("ec2").terminate_instances(InstanceIds=terminated)
            say(f"terminating {', '.join(terminated)}")
        _delete_access_point(cloud, record, say)
    deleted = delete_job_checkpoints(cloud, record, say) if delete_checkpoints else None
    return {
        "job_id": job_id,
        "was": str(was),
        "state": str(record.status),
        "workflows_stopped": stopped,
        "instances_terminated": terminated,
        "checkpoints_deleted": deleted,
    }


def _delete_access_point(cloud: Cloud, record: JobRecord, say: Say) -> None:
    """An efs job's access point goes with it, as when it ends by itself (its files stay)."""
    if not record.access_point_arn:
        return
    efs = cloud.client("efs")
    with contextlib.suppress(efs.exceptions.AccessPointNotFound):
        efs.delete_access_point(AccessPointId=record.access_point_arn.rsplit("/", 1)[-1])
    say(f"deleted EFS access point {record.access_point_arn}")


def _stop_recoveries(cloud: Cloud, job_id: str, say: Say) -> list[str]:
    sfn = cloud.client("stepfunctions")
    stopped = []
    paginator = sfn.get_paginator("list_executions")
    prefix = execution_prefix(job_id)
    for page in paginator.paginate(stateMachineArn=cloud.stack.state_machine_arn, statusFilter="RUNNING"):
        for execution in page.get("executions", []):
            if execution["name"].startswith(prefix):
                sfn.stop_execution(executionArn=execution["executionArn"], cause="spotcr cancel")
                stopped.append(execution["name"])
                say(f"recovery {execution['name']} stopped")
    return stopped


def delete_job_checkpoints(cloud: Cloud, record: JobRecord, say: Say) -> dict[str, Any]:
    """The job's checkpoints go (its stored result stays): S3 objects, or its EBS volumes once detached."""
    if record.status in ACTIVE or record.status == Status.RECOVERING:
        raise CommandError(f"job {record.job_id} is {record.status}: cancel it before deleting its checkpoints")
    if record.storage == "s3":
        s3, bucket = cloud.client("s3"), cloud.stack.bucket
        prefix = job_prefix(record.job_id)
        keys = [o["Key"] for o in jobs._objects(s3, bucket, prefix) if not is_result_key(record.job_id, o["Key"])]
        for start in range(0, len(keys), 1000):
            s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[start : start + 1000]]})
        say(f"deleted {len(keys)} objects under s3://{bucket}/{prefix} (each run's result/ folder is kept)")
        return {"storage": "s3", "objects": len(keys)}
    if record.storage == "ebs":
        return {"storage": "ebs", "volumes": _delete_volumes(cloud, record.job_id, say)}
    say(f"{record.storage}: checkpoints are under jobs/{record.job_id}/ on the file system; delete them from a VM")
    return {"storage": record.storage, "deleted": False}


def _delete_volumes(cloud: Cloud, job_id: str, say: Say, wait_s: float = 120.0) -> list[str]:
    ec2 = cloud.client("ec2")
    deadline, deleted = time.monotonic() + wait_s, []
    while True:
        volumes = ec2.describe_volumes(Filters=[{"Name": "tag:spotcr:job", "Values": [job_id]}])["Volumes"]
        pending = []
        for volume in volumes:
            if volume["State"] == "available":
                ec2.delete_volume(VolumeId=volume["VolumeId"])
                deleted.append(volume["VolumeId"])
                say(f"volume {volume['VolumeId']} deleted")
            elif volume["State"] == "in-use":
                pending.append(volume["VolumeId"])
        if not pending:
            return deleted
        if time.monotonic() > deadline:
            raise CommandError(f"volumes {', '.join(pending)} are still attached after {wait_s:.0f} s; run it again")
        time.sleep(2)


def restore(cloud: Cloud, job_id: str, checkpoint_id: str, say: Say) -> dict[str, Any]:
    """A recovery from a chosen checkpoint, through the recovery workflow: the fencing write names the checkpoint
    the restore starts its walk from, then the workflow launches a backup, retires the current instance and restores.
    """
    from spotcr_functions import config
    from spotcr_functions.recovery import recovery_input

    record = jobs.get_record(cloud, job_id)
    if record.status not in (*ACTIVE, Status.FAILED, Status.CANCELLED):
        raise CommandError(f"job {job_id} is {record.status}: {_why_not_restorable(record.status)}")
    committed = jobs.checkpoints(cloud, record)
    ids = [c.checkpoint_id for c in committed]
    if not jobs.is_checkpoint_id(checkpoint_id):
        raise CommandError(f"--checkpoint {checkpoint_id!r} is not a checkpoint id (spotcr checkpoints {job_id})", 2)
    if record.storage == "s3" and checkpoint_id not in ids:
        raise CommandError(
            f"checkpoint {checkpoint_id} is not committed for job {job_id} (spotcr checkpoints {job_id})"
        )
    older = [c for c in ids if checkpoint_order(c) < checkpoint_order(checkpoint_id)]
    # The same fencing write as an interruption's (the control plane's transition), naming the chosen checkpoint.
    registry = Registry(cloud.stack.job_table, session=_Session(cloud))
    fenced = registry.fence_for_restore(record, checkpoint_id, older[-1] if older else None, _now())
    if fenced is None:
        raise CommandError(f"job {job_id} changed while the restore was ordered; look at spotcr status {job_id}")
    # The stack's own waits are the functions' settings; their defaults are what a deployed stack uses.
    timing = _Timing(**{f.name: int(getattr(config.Settings, f.name)) for f in fields(_Timing)})
    payload = recovery_input(fenced, record.instance_id, f"user-restore:{checkpoint_id}", False, timing)
    name = execution_name(fenced.job_id, fenced.generation, fenced.recovering_from, fenced.interrupted_at)
    cloud.client("stepfunctions").start_execution(
        stateMachineArn=cloud.stack.state_machine_arn, name=name, input=json.dumps(payload, sort_keys=True)
    )
    say(f"recovery {name} started: job {job_id} generation {fenced.generation} restores from {checkpoint_id}")
    return {"job_id": job_id, "generation": fenced.generation, "checkpoint_id": checkpoint_id, "execution": name}


@dataclass(frozen=True)
class _Timing:
    final_dump_wait_s: int
    backup_ready_wait_s: int
    restore_wait_s: int
    poll_s: int


def _why_not_restorable(status: Status) -> str:
    if status == Status.RECOVERING:
        return "a recovery is under way; wait for it (spotcr status)"
    return "it completed; submit it again to run it anew"


def interrupt(cloud: Cloud, job_id: str, *, rebalance_first: bool, say: Say) -> dict[str, Any]:
    """A real spot interruption of the job's instance through the stack's FIS experiment template."""
    from spotcr_contracts import fis as fis_experiments

    record = jobs.get_record(cloud, job_id)
    if record.status not in ACTIVE:
        raise CommandError(f"job {job_id} is {record.status}: only a running job's instance can be interrupted")
    kind = fis_experiments.REBALANCE_FIRST if rebalance_first else fis_experiments.INTERRUPT
    template_id = cloud.stack.experiment_template(kind)
    ec2, fis = cloud.client("ec2"), cloud.client("fis")
    marker = [{"Key": tags.INTERRUPT, "Value": tags.INTERRUPT_REQUESTED}]
    ec2.create_tags(Resources=[record.instance_id], Tags=marker)
    try:
        experiment = fis.start_experiment(
            experimentTemplateId=template_id,
            clientToken=uuid.uuid4().hex,
            tags={"spotcr:job": job_id, "Name": f"spotcr-interrupt-{job_id}"[:128]},
        )["experiment"]
        state = _wait_for_targets(fis, experiment["id"])
    finally:
        ec2.delete_tags(Resources=[record.instance_id], Tags=marker)
    say(
        f"FIS experiment {experiment['id']} ({kind}) {state}: {record.instance_id} gets "
        f"{'a rebalance recommendation, then ' if rebalance_first else ''}the two-minute interruption notice"
    )
    return {
        "job_id": job_id,
        "instance_id": record.instance_id,
        "generation": record.generation,
        "experiment_id": experiment["id"],
        "experiment_template_id": template_id,
        "kind": kind,
        "state": state,
    }


def _wait_for_targets(fis: Any, experiment_id: str, wait_s: float = 60.0) -> str:
    """FIS resolves the targets when the experiment leaves `initiating`; the marker tag must stay until then."""
    deadline = time.monotonic() + wait_s
    while True:
        state = fis.get_experiment(id=experiment_id)["experiment"]["state"]
        status = str(state.get("status", ""))
        if status == "failed":
            raise CommandError(f"FIS experiment {experiment_id} failed: {state.get('reason', '')}")
        if status not in ("pending", "initiating") or time.monotonic() > deadline:
            return status
        time.sleep(1)
