"""Capabilities (declared in spotcr_functions.catalog) turned into the narrowest IAM statements.

Functions and the recovery workflow declare what they call; this module is the only place that
knows which IAM actions, resources and conditions a capability means. No statement has a `*`
action; every statement whose resource holds a wildcard carries the reason, and that reason
becomes the cdk-nag acknowledgment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import aws_cdk as cdk
from aws_cdk import aws_iam as iam
from spotcr_contracts import tags
from spotcr_functions import catalog, store_access

from infra import ebs_key
from infra.nag import acknowledge_wildcard_resource


@dataclass(frozen=True)
class Grant:
    statement: iam.PolicyStatement
    wildcard_reason: str | None = None  # why a resource ends in `*`, where IAM allows nothing narrower


@dataclass(frozen=True)
class GrantTargets:
    """ARNs and names the capabilities refer to."""

    jobs_table_arn: str
    jobs_index_names: tuple[str, ...]
    idempotency_table_arn: str
    document_names: Mapping[str, str]  # command name -> SSM document name
    launch_template_id: str
    job_role_arn: str
    state_machine_arn: str
    failure_topic_arn: str
    failure_topic_key_arn: str
    checkpoint_bucket_name: str
    job_spec_buckets: tuple[str, ...]
    stack: cdk.Stack
    store_role_arn: str = ""
    file_system_arn: str = ""  # the stack's EFS (efs=true); without it the EFS capabilities grant nothing
    ebs_kms_key_arn: str = ""  # the EBS encryption key (setting ebs_kms_key_arn); empty: any key of the account


def _arn(t: GrantTargets, service: str, resource: str, name: str, *, account: str | None = None) -> str:
    return t.stack.format_arn(
        service=service,
        resource=resource,
        resource_name=name,
        account=account,
        arn_format=cdk.ArnFormat.SLASH_RESOURCE_NAME,
    )


_JOB_INSTANCE_CONDITION = {"StringLike": {f"ssm:resourceTag/{tags.JOB}": "?*"}}
_EC2_JOB_CONDITION = {"StringLike": {f"aws:ResourceTag/{tags.JOB}": "?*"}}


def _jobs_read(t: GrantTargets) -> list[Grant]:
    indexes = [f"{t.jobs_table_arn}/index/{name}" for name in t.jobs_index_names]
    return [
        Grant(
            iam.PolicyStatement(
                actions=["dynamodb:GetItem", "dynamodb:Query"],
                resources=[t.jobs_table_arn, *indexes],
            )
        )
    ]


def _jobs_write(t: GrantTargets) -> list[Grant]:
    return [
        Grant(
            iam.PolicyStatement(
                actions=["dynamodb:PutItem", "dynamodb:UpdateItem"],
                resources=[t.jobs_table_arn],
            )
        )
    ]


def _idempotency(t: GrantTargets) -> list[Grant]:
    return [
        Grant(
            iam.PolicyStatement(
                actions=["dynamodb:GetItem", "dynamodb:PutItem", "dynamodb:UpdateItem", "dynamodb:DeleteItem"],
                resources=[t.idempotency_table_arn],
            )
        )
    ]


def _send_command(t: GrantTargets) -> list[Grant]:
    documents = [_arn(t, "ssm", "document", name) for name in t.document_names.values()]
    return [
        Grant(iam.PolicyStatement(actions=["ssm:SendCommand"], resources=documents)),
        Grant(
            iam.PolicyStatement(
                actions=["ssm:SendCommand"],
                resources=[_arn(t, "ec2", "instance", "*")],
                conditions=_JOB_INSTANCE_CONDITION,
            ),
            "SendCommand targets job instances whose ids are only known at run time; "
            "the ssm:resourceTag/spotcr:job condition limits it to instances carrying the job tag.",
        ),
    ]


def _command_results(t: GrantTargets) -> list[Grant]:
    return [
        Grant(
            iam.PolicyStatement(
                actions=["ssm:GetCommandInvocation"],
                resources=["*"],
            ),
            "GetCommandInvocation supports no resource-level permissions; it is read-only.",
        )
    ]


def _ec2_describe(t: GrantTargets) -> list[Grant]:
    return [
        Grant(
            iam.PolicyStatement(
                actions=[
                    "ec2:DescribeInstances",
                    "ec2:DescribeInstanceTypes",
                    "ec2:DescribeSubnets",
                    "ec2:DescribeVolumes",
                    "ec2:DescribeSnapshots",
                    "ec2:DescribeImages",  # the recovery's plan checks that the job's image still exists
                ],
                resources=["*"],
            ),
            "EC2 Describe actions support no resource-level permissions; they are read-only.",
        )
    ]


# The tags registering writes on a job's instance (spotcr_functions.jobs): the run it mints, or why it refused the job.
REGISTRATION_TAGS = (tags.RUN, tags.ERROR)


def _ec2_tag(t: GrantTargets) -> list[Grant]:
    return [
        Grant(
            iam.PolicyStatement(
                actions=["ec2:CreateTags"],
                resources=[_arn(t, "ec2", "instance", "*")],
                conditions={
                    **_EC2_JOB_CONDITION,
                    "ForAllValues:StringEquals": {"aws:TagKeys": list(REGISTRATION_TAGS)},
                },
            ),
            "CreateTags writes only the spotcr:run and spotcr:error keys (aws:TagKeys) on instances carrying "
            "spotcr:job, whose ids are known only at run time.",
        )
    ]


def _ec2_launch(t: GrantTargets) -> list[Grant]:
    template_arn = _arn(t, "ec2", "launch-template", t.launch_template_id)
    launched = [
        _arn(t, "ec2", kind, "*")
        for kind in ("instance", "volume", "network-interface", "subnet", "security-group", "spot-instances-request")
    ]
    image = _arn(t, "ec2", "image", "*", account="")
    reason = (
        "RunInstances creates instances, volumes and interfaces with ids unknown in advance; "
        "the ec2:LaunchTemplate condition allows it only from spotcr's launch template."
    )
    grants = [
        Grant(iam.PolicyStatement(actions=["ec2:RunInstances"], resources=[template_arn])),
        Grant(
            iam.PolicyStatement(
                actions=["ec2:RunInstances"],
                resources=[*launched, image],
                conditions={"ArnLike": {"ec2:LaunchTemplate": template_arn}},
            ),
            reason,
        ),
        # A spot backup is one instant EC2 Fleet: CreateFleet on the fleet and what it names, and the instances
        # it launches are authorized as RunInstances (above) with this caller's permissions.
        Grant(
            iam.PolicyStatement(
                actions=["ec2:CreateFleet"],
                resources=[_arn(t, "ec2", "fleet", "*"), template_arn, *launched, image],
            ),
            "An instant fleet's id is unknown before the call; what it launches is limited by the RunInstances "
            "grant above to spotcr's launch template.",
        ),
        Grant(
            iam.PolicyStatement(
                actions=["ec2:CreateTags"],
                resources=[_arn(t, "ec2", kind, "*") for kind in ("instance", "volume", "spot-instances-request")]
                + [_arn(t, "ec2", "network-interface", "*")],
                conditions={"StringEquals": {"ec2:CreateAction": ["RunInstances", "CreateFleet"]}},
            ),
            "Tags can only be written while launching (ec2:CreateAction = RunInstances or CreateFleet) on "
            "resources whose ids do not exist before the call.",
        ),
        Grant(
            iam.PolicyStatement(
                actions=["iam:PassRole"],
                resources=[t.job_role_arn],
                conditions={"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}},
            )
        ),
        *_ebs_key(t),
    ]
    return grants


def _ebs_key(t: GrantTargets) -> list[Grant]:
    """What the caller of RunInstances and CreateVolume needs on a customer managed EBS key (infra/ebs_key.py)."""
    key = t.ebs_kms_key_arn or _arn(t, "kms", "key", "*")
    through_ec2 = ebs_key.through_ec2(t.stack.region, t.stack.account)
    reason = (
        None
        if t.ebs_kms_key_arn
        else "EBS encrypts job volumes under the account's default EBS key, unknown at synth (setting ebs_kms_key_arn "
        "names it); kms:ViaService and kms:CallerAccount allow the key only as EC2 uses it for this account."
    )
    return [
        Grant(
            iam.PolicyStatement(actions=list(ebs_key.USE_ACTIONS), resources=[key], conditions=through_ec2),
            reason,
        ),
        Grant(
            iam.PolicyStatement(
                actions=[ebs_key.GRANT_ACTION],
                resources=[key],
                conditions={**through_ec2, **ebs_key.GRANT_FOR_AWS_RESOURCE},
            ),
            reason,
        ),
    ]


def _ec2_terminate(t: GrantTargets) -> list[Grant]:
    return [
        Grant(
            iam.PolicyStatement(
                actions=["ec2:TerminateInstances"],
                resources=[_arn(t, "ec2", "instance", "*")],
                conditions={"StringEquals": {f"aws:ResourceTag/{tags.LAUNCH_TEMPLATE}": t.launch_template_id}},
            ),
            "Backups that failed and interrupted (stopped, hibernated) job instances are terminated; EC2 tags every "
            "instance launched from a template with aws:ec2launchtemplate:id, so only instances from spotcr's "
            "template qualify.",
        ),
        Grant(
            iam.PolicyStatement(
                actions=["ec2:CancelSpotInstanceRequests"],
                resources=[_arn(t, "ec2", "spot-instances-request", "*")],
            ),
            "The persistent spot request of an interrupted job instance (its id read from that instance) is "
            "cancelled so EC2 does not start it again; users create these requests, so they carry no spotcr tag. "
            "Cancelling only stops future launches.",
        ),
    ]


def _ec2_addresses(t: GrantTargets) -> list[Grant]:
    return [
        Grant(
            iam.PolicyStatement(
                actions=["ec2:AssignPrivateIpAddresses"],
                resources=[_arn(t, "ec2", "network-interface", "*")],
            ),
            "A node of a job over several VMs keeps its private address for the run: the recovery moves it to the "
            "node's backup (AllowReassignment). Network interfaces carry no spotcr tag to scope by; EC2 moves an "
            "address only within its subnet, and the recovery moves only an address its job's record names.",
        )
    ]


def _ec2_volumes(t: GrantTargets) -> list[Grant]:
    """Volumes and snapshots spotcr created carry spotcr:stack (written only at creation, ec2:CreateAction): attach,
    detach, snapshot and delete require it, never the user-writable spotcr:job alone. The instances they attach to
    are the job's (a user's own, submitted by tag, or a backup), so for instances spotcr:job is what qualifies."""
    volume = _arn(t, "ec2", "volume", "*")
    instance = _arn(t, "ec2", "instance", "*")
    snapshot = _arn(t, "ec2", "snapshot", "*", account="")
    created_by_stack = {"StringEquals": {f"aws:ResourceTag/{tags.STACK}": t.stack.stack_name}}
    tagged_for_stack = {
        "StringLike": {f"aws:RequestTag/{tags.JOB}": "?*"},
        "StringEquals": {f"aws:RequestTag/{tags.STACK}": t.stack.stack_name},
    }
    return [
        Grant(
            iam.PolicyStatement(
                actions=["ec2:CreateVolume"],
                resources=[volume, snapshot],
                conditions={**tagged_for_stack, "Bool": {"ec2:Encrypted": "true"}},
            ),
            "CreateVolume makes a volume (possibly from a job snapshot) whose id is unknown in advance; it must be "
            "encrypted and tagged spotcr:job and this stack's spotcr:stack.",
        ),
        Grant(
            iam.PolicyStatement(
                actions=["ec2:AttachVolume", "ec2:DetachVolume", "ec2:DeleteVolume", "ec2:CreateSnapshot"],
                resources=[volume],
                conditions=created_by_stack,
            ),
            "Job volumes are created at run time; only volumes this stack created (spotcr:stack, which its roles "
            "write only at creation) qualify.",
        ),
        Grant(
            iam.PolicyStatement(
                actions=["ec2:AttachVolume", "ec2:DetachVolume"],
                resources=[instance],
                conditions=_EC2_JOB_CONDITION,
            ),
            "A job's volume attaches to the job's instance (the user's own, submitted by tag, or a backup), whose id "
            "is known only at run time; only instances carrying spotcr:job qualify.",
        ),
        Grant(
            iam.PolicyStatement(actions=["ec2:CreateSnapshot"], resources=[snapshot], conditions=tagged_for_stack),
            "Snapshots that move a job volume across zones get ids at run time; they are created tagged spotcr:job "
            "and this stack's spotcr:stack.",
        ),
        Grant(
            iam.PolicyStatement(
                actions=["ec2:DeleteSnapshot"],
                resources=[snapshot],
                # DeleteSnapshot carries no request tags: the snapshot's own tag (set at creation) is what qualifies.
                conditions=created_by_stack,
            ),
            "A hand-over snapshot is deleted once the volume made from it is committed; only snapshots this stack "
            "created (spotcr:stack) qualify.",
        ),
        Grant(
            iam.PolicyStatement(
                actions=["ec2:CreateTags"],
                resources=[volume, snapshot],
                conditions={"StringEquals": {"ec2:CreateAction": ["CreateVolume", "CreateSnapshot"]}},
            ),
            "Tags can only be written while creating a job volume or snapshot (ec2:CreateAction).",
        ),
        *_ebs_key(t),
    ]


def _start_recovery(t: GrantTargets) -> list[Grant]:
    return [Grant(iam.PolicyStatement(actions=["states:StartExecution"], resources=[t.state_machine_arn]))]


def _task_callback(t: GrantTargets) -> list[Grant]:
    return [
        Grant(
            iam.PolicyStatement(
                actions=["states:SendTaskSuccess", "states:SendTaskFailure"],
                resources=[t.state_machine_arn],
            )
        )
    ]


def _publish_failure(t: GrantTargets) -> list[Grant]:
    return [
        Grant(iam.PolicyStatement(actions=["sns:Publish"], resources=[t.failure_topic_arn])),
        Grant(
            iam.PolicyStatement(
                actions=["kms:GenerateDataKey", "kms:Decrypt"],
                resources=[t.failure_topic_key_arn],
            )
        ),
    ]


def _store_credentials(t: GrantTargets) -> list[Grant]:
    return [
        Grant(
            iam.PolicyStatement(
                actions=["sts:AssumeRole", "sts:TagSession"],
                resources=[t.store_role_arn],
                conditions={"StringLike": {f"aws:RequestTag/{store_access.SESSION_TAG}": "?*"}},
            )
        )
    ]


def _access_point_arn(t: GrantTargets) -> str:
    return _arn(t, "elasticfilesystem", "access-point", "*")


def _efs_access_points(t: GrantTargets) -> list[Grant]:
    if not t.file_system_arn:
        return []
    job_tagged = {"StringLike": {f"aws:RequestTag/{tags.JOB}": "?*"}}
    return [
        Grant(
            iam.PolicyStatement(
                actions=["elasticfilesystem:CreateAccessPoint"], resources=[t.file_system_arn], conditions=job_tagged
            )
        ),
        Grant(
            iam.PolicyStatement(
                actions=["elasticfilesystem:TagResource"],
                resources=[_access_point_arn(t)],
                conditions={"StringEquals": {"elasticfilesystem:CreateAction": "CreateAccessPoint"}},
            ),
            "Access points get ids at run time; tags can only be written while creating one "
            "(elasticfilesystem:CreateAction).",
        ),
        Grant(
            iam.PolicyStatement(
                actions=["elasticfilesystem:DescribeAccessPoints"],
                resources=[_access_point_arn(t)],
                conditions=_EC2_JOB_CONDITION,
            ),
            "A retried registration reads the access point its first try made (ids are known only at run time); "
            "only access points tagged spotcr:job qualify.",
        ),
        *_efs_access_point_delete(t),
    ]


def _efs_access_point_delete(t: GrantTargets) -> list[Grant]:
    if not t.file_system_arn:
        return []
    return [
        Grant(
            iam.PolicyStatement(
                actions=["elasticfilesystem:DeleteAccessPoint"],
                resources=[_access_point_arn(t)],
                conditions=_EC2_JOB_CONDITION,
            ),
            "A job's access point gets its id at run time; only access points tagged spotcr:job qualify.",
        )
    ]


# The store role's session tag: which job's prefix a vended session may touch (store_access.vend sets it).
JOB_SESSION_TAG = store_access.JOB


def job_store(bucket_arn: str, file_system_arn: str | None = None, key_arn: str | None = None) -> list[Grant]:
    """For the store role that store-credentials assumes: objects and listing under jobs/<the session's job>/ only,
    (with EFS) mounting the file system through an access point, never its root, and (with a checkpoint key) the
    key as S3 uses it to write and read the bucket's objects.

    The prefix comes from the session tag, so a session without the tag matches no resource; the session policy
    store_access.session_policy names the same prefix. EFS enforces no aws:PrincipalTag condition for NFS clients
    (see store_access), so here any access point is allowed and the session policy names the job's own.
    """
    prefix = f"jobs/{JOB_SESSION_TAG}/"
    return [
        Grant(
            iam.PolicyStatement(
                actions=["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
                resources=[f"{bucket_arn}/{prefix}*"],
            ),
            "One job's checkpoints: the prefix is jobs/<the session's SpotcrJob tag>/, set by store-credentials "
            "only for a job whose record names the calling instance.",
        ),
        Grant(
            iam.PolicyStatement(
                actions=["s3:ListBucket"],
                resources=[bucket_arn],
                conditions={"StringLike": {"s3:prefix": [f"{prefix}*"]}},
            )
        ),
        *(
            [
                Grant(
                    iam.PolicyStatement(
                        actions=list(store_access.EFS_CLIENT_ACTIONS),
                        resources=[file_system_arn],
                        conditions={"StringLike": {store_access.ACCESS_POINT_KEY: _ANY_ACCESS_POINT}},
                    )
                )
            ]
            if file_system_arn
            else []
        ),
        *checkpoint_key(bucket_arn, key_arn, store_access.KEY_ACTIONS),
    ]


def checkpoint_key(bucket_arn: str, key_arn: str | None, actions: Iterable[str]) -> list[Grant]:
    """The checkpoint bucket's KMS key (setting checkpoint_key), only as S3 uses it for that bucket; none without."""
    if key_arn is None:
        return []
    return [
        Grant(
            iam.PolicyStatement(
                actions=list(actions),
                resources=[key_arn],
                conditions=store_access.through_s3(cdk.Aws.REGION, bucket_arn),
            )
        )
    ]


# Any access point of this account and region: a mount without one has no AccessPointArn and matches nothing.
_ANY_ACCESS_POINT = f"arn:{cdk.Aws.PARTITION}:elasticfilesystem:{cdk.Aws.REGION}:{cdk.Aws.ACCOUNT_ID}:access-point/*"


def job_specs(checkpoint_bucket_name: str, job_spec_buckets: Iterable[str]) -> Grant:
    """For the job VMs' role: the agent on the VM reads the spec its spotcr:spec tag names (no function does)."""
    resources = [f"arn:{cdk.Aws.PARTITION}:s3:::{checkpoint_bucket_name}/specs/*"]
    resources += [f"arn:{cdk.Aws.PARTITION}:s3:::{bucket}/*" for bucket in job_spec_buckets]
    return Grant(
        iam.PolicyStatement(actions=["s3:GetObject"], resources=resources),
        "Job specs are objects named by users in their spotcr:spec tag, read by the job VM only under specs/ of "
        "the checkpoint bucket or in buckets the deployer listed in job_spec_buckets.",
    )


CAPABILITIES: dict[str, Callable[[GrantTargets], list[Grant]]] = {
    catalog.JOBS_READ: _jobs_read,
    catalog.JOBS_WRITE: _jobs_write,
    catalog.IDEMPOTENCY: _idempotency,
    catalog.SEND_COMMAND: _send_command,
    catalog.COMMAND_RESULTS: _command_results,
    catalog.EC2_DESCRIBE: _ec2_describe,
    catalog.EC2_TAG: _ec2_tag,
    catalog.EC2_LAUNCH: _ec2_launch,
    catalog.EC2_TERMINATE: _ec2_terminate,
    catalog.EC2_VOLUMES: _ec2_volumes,
    catalog.EC2_ADDRESSES: _ec2_addresses,
    catalog.START_RECOVERY: _start_recovery,
    catalog.TASK_CALLBACK: _task_callback,
    catalog.PUBLISH_FAILURE: _publish_failure,
    catalog.STORE_CREDENTIALS: _store_credentials,
    catalog.EFS_ACCESS_POINTS: _efs_access_points,
    catalog.EFS_ACCESS_POINT_DELETE: _efs_access_point_delete,
}


def grants_for(capabilities: Iterable[str], targets: GrantTargets) -> list[Grant]:
    """The statements for these capabilities; an unknown capability is an error naming it."""
    result: list[Grant] = []
    for capability in capabilities:
        build = CAPABILITIES.get(capability)
        if build is None:
            raise KeyError(f"capability {capability!r} has no IAM mapping in infra/grants.py")
        result += build(targets)
    return result


def apply(role: iam.IRole, grants: Iterable[Grant]) -> None:
    """Add the statements to the role and acknowledge each wildcard resource with its reason."""
    for grant in grants:
        role.add_to_principal_policy(grant.statement)
        for resource in grant.statement.resources:
            if "*" not in resource:
                continue
            if grant.wildcard_reason is None:
                raise ValueError(f"wildcard resource {resource} granted without a reason")
            acknowledge_wildcard_resource(role, resource, grant.wildcard_reason)
