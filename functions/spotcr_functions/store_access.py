"""Per-run store credentials: a job VM gets S3 credentials for its own run's prefix, and nothing else.

The job VM calls the store-credentials function URL (AuthType AWS_IAM), or with private subnets the private API
in front of the same function (AWS_IAM), signing with its instance role. Lambda (or API Gateway) verifies the
signature and names the caller in the event: an instance profile session is
`arn:aws:sts::<account>:assumed-role/<job role>/<instance id>`. The caller names its job (`?job=`); the job's
record must name that instance as its current instance, its backup, or the instance whose interruption it is
recovering from (that one still writes the final dump). Only then is the store role assumed for one hour (the
role-chaining limit) with the job as session tag `SpotcrJob`, which the store role's policy uses as
`jobs/${aws:PrincipalTag/SpotcrJob}/`, and with a session policy narrower still: the objects of the record's run
(`jobs/<job>/runs/<run>/`), and of the name's other runs only the checkpoint state an ended run leaves behind
(checkpoints, chunks, commit and sweep markers), which the new run prunes: it reads and deletes them, and writes
there only its own sweep marker (CheckpointStore.delete_run), never a checkpoint, chunk or commit marker, so a VM
still holding an ended run's session cannot write what the name's current run restores; never another run's
result. IAM cannot say "any run but the caller's" (run ids are random, the current one unknown when a session
is vended), so until it expires (at most an hour) such a session can still delete the current run's checkpoint
state (a restore then walks back past it, or starts over) or hold its commits off with a sweep marker (its
checkpoints then fail to commit). Of the job it also reaches the logs kept for `spotcr logs` (`criu-logs/`,
`agent-logs/`, shared by the name's runs). Listing stays job-wide (key names, no contents): the new run finds the
earlier runs to prune by it.

EFS (efs storage): the session policy also allows ClientMount, ClientWrite and ClientRootAccess on the file system
only with `elasticfilesystem:AccessPointArn` equal to this job's access point (efs_access). The session tag cannot
do this part: for NFS clients EFS enforces only aws:SecureTransport, aws:SourceIp, elasticfilesystem:AccessPointArn
and elasticfilesystem:AccessedViaMountTarget ("No other condition keys are enforced", Amazon EFS User Guide, "Using
IAM to control file system data access", EFS condition keys for clients), so no aws:PrincipalTag condition. A session
policy narrows what the session may do whatever the service (IAM User Guide, "Session policies"), and the store
role's own grant already requires some access point, so a vended session never mounts the file system's root.

A checkpoint key (setting checkpoint_key): the bucket encrypts with that KMS key by default (SSE-KMS, S3 Bucket Keys),
and S3 asks KMS as the caller, kms:GenerateDataKey to write an object and kms:Decrypt to read one. The store role
allows both on that key only through S3 and only for this bucket (`through_s3`: with Bucket Keys the encryption
context is the bucket's ARN, Amazon S3 User Guide, "Reducing the cost of SSE-KMS with Amazon S3 Bucket Keys"). The
session policy names the key without repeating those conditions: it only narrows the role's grant, and AssumeRole
takes at most 2,048 characters of it (hence, too, the job named by its session tag and `elasticfilesystem:Client*`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from spotcr_contracts import layout, nodes, tags
from spotcr_contracts.layout import job_prefix, run_prefix
from spotcr_contracts.settings import ENV

from spotcr_functions.deps import Deps
from spotcr_functions.models import ENDED, INSTANCE_ID_PATTERN, JobRecord, Status

SESSION_SECONDS = 3600  # role chaining (an instance role session assuming the store role) caps sessions at 1 hour
OBJECT_ACTIONS = ("s3:GetObject", "s3:PutObject", "s3:DeleteObject")
PRUNE_ACTIONS = ("s3:GetObject", "s3:DeleteObject")
LIST_ACTION = "s3:ListBucket"
EFS_CLIENT_ACTIONS = (
    "elasticfilesystem:ClientMount",
    "elasticfilesystem:ClientWrite",
    "elasticfilesystem:ClientRootAccess",
)
# In the session policy, which only narrows the role's grant of exactly those three: the same, in fewer characters
EFS_CLIENT_WILDCARD = "elasticfilesystem:Client*"
ACCESS_POINT_KEY = "elasticfilesystem:AccessPointArn"
_ASSUMED_ROLE = re.compile(r"^arn:(aws[a-z-]*):sts::(\d{12}):assumed-role/([\w+=,.@-]{1,64})/([\w+=,.@-]{2,64})$")
_INSTANCE_ID = re.compile(INSTANCE_ID_PATTERN)
# IAM's `?` matches one character: a run id (r- and 16 hex digits), so the pattern never reaches into result/.
ANY_RUN = "r-" + "?" * 16
# What a run leaves behind that a later run of its name deletes (Agent.delete_earlier_runs); result/ is not here.
PRUNABLE = ("checkpoints", "chunks", "commits", "sweeps")
# What that delete writes in the earlier run: its sweep marker, which holds off a late commit of that run.
PRUNE_MARKERS = "sweeps"
# The job's kept logs, which every run of the name writes.
JOB_LOGS = (layout.CRIU_LOGS, layout.AGENT_LOGS)
KEY_ACTIONS = ("kms:GenerateDataKey", "kms:Decrypt")  # what S3 asks KMS as the caller: writing, reading
KEY_READ_ACTIONS = ("kms:Decrypt",)
# The session tag naming the job: letters only, so `${aws:PrincipalTag/SpotcrJob}` keeps ARNs parseable by tools.
SESSION_TAG = "SpotcrJob"
JOB = f"${{aws:PrincipalTag/{SESSION_TAG}}}"  # the job's name in the session's own policies, from its session tag


class Refused(Exception):
    """A request for store credentials that is not granted; `status` is the HTTP status the URL answers."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Caller:
    partition: str
    account: str
    instance_id: str


def caller_instance(user_arn: str | None, job_role_name: str) -> Caller:
    """The instance behind an instance profile session of the job role; anything else is refused."""
    if not user_arn:
        raise Refused(403, "no IAM caller in the request: the function URL or API method must use AWS_IAM auth")
    match = _ASSUMED_ROLE.match(user_arn)
    if match is None:
        raise Refused(403, f"caller {user_arn[:200]} is not an assumed-role session")
    partition, account, role, session = match.groups()
    if role != job_role_name:
        raise Refused(403, f"caller role {role} is not the job VMs' role {job_role_name}")
    if not _INSTANCE_ID.match(session):
        raise Refused(403, f"caller session {session} is not an instance profile session (an instance id)")
    return Caller(partition, account, session)


def check_job_name(job_id: str | None) -> str:
    if not job_id:
        raise Refused(400, "missing query parameter job: the job whose store credentials are wanted")
    if not tags.JOB_NAME.fullmatch(job_id):
        raise Refused(400, f"job {job_id[:80]!r} is not a job name (1-63 of a-z, 0-9 and '-')")
    return job_id


def instances_of(record: JobRecord) -> tuple[str, ...]:
    """The instances that may hold the job: current, backup, and the one a recovery is moving it from."""
    candidates: list[str | None] = [record.instance_id, *record.backups(), *(n.instance_id for n in record.nodes)]
    if record.status == Status.RECOVERING:
        candidates.append(record.recovering_from)
    return tuple(instance for instance in candidates if instance)


def authorize(record: JobRecord | None, job_id: str, instance_id: str) -> JobRecord:
    """The job's record, when it grants this instance its run's store; Refused otherwise."""
    if record is None:
        raise Refused(404, f"unknown job {job_id}: it is not registered (yet)")
    if record.status in ENDED:
        # 410, not 403: an ended job never gets credentials again, so the agent stops asking at once.
        raise Refused(410, f"job {job_id} has ended ({record.status.value}); its store is read by users, not VMs")
    if not record.run_id:
        raise Refused(404, f"job {job_id} has no run yet (it is minted with its registration)")
    if instance_id not in instances_of(record):
        raise Refused(403, f"instance {instance_id} is not running job {job_id}")
    return record


def file_system_arn(access_point_arn: str, file_system_id: str) -> str:
    """The file system's ARN beside its access point's (same partition, region and account)."""
    return f"{access_point_arn.rsplit(':', 1)[0]}:file-system/{file_system_id}"


def through_s3(region: str, bucket_arn: str) -> dict[str, dict[str, str]]:
    """The condition on a checkpoint key: used by S3 in its region, for this bucket's objects (S3 Bucket Keys)."""
    return {
        "StringEquals": {
            "kms:ViaService": f"s3.{region}.amazonaws.com",
            "kms:EncryptionContext:aws:s3:arn": bucket_arn,
        }
    }


def session_policy(
    partition: str,
    bucket: str,
    run_id: str,
    *,
    access_point_arn: str | None = None,
    file_system_id: str = "",
    key_arn: str = "",
) -> dict[str, Any]:
    """The session policy: the run's objects and the job's kept logs; of the name's other runs, reading and
    deleting the checkpoint state (to prune it) and writing only the prune's sweep marker; listing only under the
    job's prefix; (efs storage) mounting the file system only through the job's access point, and (a checkpoint
    key) that key, as far as the store role allows it (only as S3 uses it for this bucket). The job is named by the
    session tag (JOB), not spelled out: AssumeRole takes at most 2,048 characters of policy, which a 63-character
    name repeated in every resource would overrun (2,290 with EFS and a key)."""
    job_id = JOB
    objects = f"arn:{partition}:s3:::{bucket}/"
    other_runs = f"{objects}{run_prefix(job_id, ANY_RUN)}"
    statements: list[dict[str, Any]] = [
        {
            "Effect": "Allow",
            "Action": list(OBJECT_ACTIONS),
            "Resource": [
                f"{objects}{run_prefix(job_id, run_id)}*",
                *(f"{objects}{job_prefix(job_id)}{logs}/*" for logs in JOB_LOGS),
            ],
        },
        {
            "Effect": "Allow",
            "Action": list(PRUNE_ACTIONS),
            "Resource": [f"{other_runs}{part}/*" for part in PRUNABLE],
        },
        {
            "Effect": "Allow",
            "Action": "s3:PutObject",
            "Resource": f"{other_runs}{PRUNE_MARKERS}/*",
        },
        {
            "Effect": "Allow",
            "Action": LIST_ACTION,
            "Resource": f"arn:{partition}:s3:::{bucket}",
            "Condition": {"StringLike": {"s3:prefix": f"{job_prefix(job_id)}*"}},
        },
    ]
    if key_arn:
        statements.append({"Effect": "Allow", "Action": list(KEY_ACTIONS), "Resource": key_arn})
    if access_point_arn:
        statements.append(
            {
                "Effect": "Allow",
                "Action": EFS_CLIENT_WILDCARD,
                "Resource": file_system_arn(access_point_arn, file_system_id),
                "Condition": {"StringEquals": {ACCESS_POINT_KEY: access_point_arn}},
            }
        )
    return {"Version": "2012-10-17", "Statement": statements}


def vend(deps: Deps, job_id: str | None, user_arn: str | None) -> dict[str, Any]:
    """Credentials for the caller's job store, as the agent's credential provider reads them."""
    settings = deps.settings
    if not settings.store_role_arn or not settings.job_role_name:
        raise RuntimeError(f"store credentials need {ENV['store_role_arn']} and {ENV['job_role_name']}")
    caller = caller_instance(user_arn, settings.job_role_name)
    job = check_job_name(job_id)
    record = authorize(deps.registry.get(job), job, caller.instance_id)
    node = node_answer(record, caller.instance_id)
    access_point = access_point_of(record, settings.file_system_id)
    policy = session_policy(
        caller.partition,
        settings.checkpoint_bucket,
        record.run_id,
        access_point_arn=access_point,
        file_system_id=settings.file_system_id,
        key_arn=settings.checkpoint_key_arn,
    )
    credentials = deps.cloud.assume_store_role(
        role_arn=settings.store_role_arn,
        session_name=caller.instance_id,
        policy=policy,
        session_tags={SESSION_TAG: job},
        duration_s=SESSION_SECONDS,
    )
    return {
        "Version": 1,
        "AccessKeyId": credentials["AccessKeyId"],
        "SecretAccessKey": credentials["SecretAccessKey"],
        "SessionToken": credentials["SessionToken"],
        "Expiration": _iso(credentials["Expiration"]),
        "Job": job,
        "Run": record.run_id,
        "Prefix": run_prefix(job, record.run_id),
        **node,
        **(
            {"FileSystemId": settings.file_system_id, "AccessPointId": access_point.rsplit("/", 1)[-1]}
            if access_point
            else {}
        ),
    }


def node_answer(record: JobRecord, instance_id: str) -> dict[str, Any]:
    """What a node of a job over several VMs learns with its credentials: every node's address in index order, its
    own index, and the run's launch key (docs/design/multinode.md). Only once every node registered: until then
    Refused (404), which the agent asks again after. A recovery's backup learns the node it takes over. Nothing for
    a single-VM job."""
    if not record.node_count:
        return {}
    node = record.node_of(instance_id)
    if node is None and instance_id == record.backup_instance_id and record.interrupted_node is not None:
        node = record.node(record.interrupted_node)
    lost = next((index for index, lost in record.lost_nodes.items() if lost.backup == instance_id), None)
    if node is None and lost is not None:
        node = record.node(lost)
    if node is None:
        raise Refused(403, f"instance {instance_id} holds no node of job {record.job_id}")
    listed = nodes.addresses(record.nodes, record.node_count)
    if listed is None:
        raise Refused(
            404, f"job {record.job_id} has {len(record.nodes)} of its {record.node_count} nodes registered: wait"
        )
    return {"Nodes": list(listed), "Node": node.index, "LaunchKey": record.launch_key}


def access_point_of(record: JobRecord, file_system_id: str) -> str | None:
    """The job's access point ARN; an efs job registered with the stack's EFS waits until it has one."""
    if record.storage != "efs" or not file_system_id:
        return None
    if not record.access_point_arn:
        raise Refused(404, f"job {record.job_id} has no EFS access point yet (it is made with its registration)")
    return record.access_point_arn


def _iso(value: Any) -> str:
    return value.isoformat().replace("+00:00", "Z") if hasattr(value, "isoformat") else str(value)
