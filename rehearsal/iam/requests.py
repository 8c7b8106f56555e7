"""Which IAM requests one AWS API call makes: (action, resource ARN, condition keys), as AWS builds them.

From the Service Authorization Reference ("Actions, resources, and condition keys for <service>"): an API call may
be authorized as several requests (RunInstances: the instance, its image, subnet, security groups, interfaces,
volumes and launch template, the tags written on create as ec2:CreateTags, iam:PassRole for the instance profile's
role), and every one must be allowed. A resource that the call creates has no id yet: AWS evaluates it as
`<type>/*`. Resource tags (`aws:ResourceTag/*`, `ec2:ResourceTag/*`, `ssm:resourceTag/*`) are the resource's tags
as they are before the call, read from the local AWS (`State`). An operation that has no entry here is an error
(UnknownOperation), never an allow: add its entry from the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from rehearsal.iam.policy import ContextValue, Request


class UnknownOperation(LookupError):
    """An API operation whose IAM requests are not described here."""


class State(Protocol):
    """What the requests need to know of the local AWS before the call."""

    def ec2_tags(self, resource_id: str) -> Mapping[str, str]: ...
    def launch_template(self, template_id: str, template_name: str, version: str) -> tuple[str, Mapping[str, Any]]:
        """(template id, the version's LaunchTemplateData)."""
        ...

    def subnet_default(self, launch_data: Mapping[str, Any]) -> str: ...
    def instance_profile_roles(self, profile: Mapping[str, str]) -> Sequence[str]: ...
    def state_machine_of_token(self, token: str) -> str: ...
    def topic_key(self, topic_arn: str) -> str: ...
    def access_point_tags(self, access_point_id: str) -> Mapping[str, str]: ...
    def file_system_arn(self, file_system_id: str) -> str: ...
    def stack_arn(self, stack_name: str) -> str: ...
    def role_arn(self, role_name: str) -> str:
        """The role's ARN, its path included; `role/<name>` for a role that does not exist."""
        ...

    def kms_key_arn(self, key_id: str) -> str:
        """The key a key id, key ARN, alias name or alias ARN names."""
        ...

    def bucket_encryption(self, bucket: str) -> SseKms | None:
        """The bucket's default encryption when it is SSE-KMS; None for SSE-S3 (or no such bucket)."""
        ...

    def object_encryption(self, bucket: str, key: str) -> SseKms | None:
        """How the object was encrypted when with SSE-KMS; None for SSE-S3 (or no such object)."""
        ...


@dataclass(frozen=True)
class SseKms:
    """SSE-KMS: the key's ARN, and whether S3 Bucket Keys are on (then the encryption context is the bucket's ARN,
    else the object's)."""

    key_arn: str
    bucket_key: bool


@dataclass(frozen=True)
class Call:
    service: str  # the IAM prefix: ec2, ssm, dynamodb, states, sns, sts, elasticfilesystem, s3, events, lambda
    operation: str  # the API operation: CreateTags
    params: Mapping[str, Any]  # the request's parameters as botocore names them
    region: str
    account: str


def _tag_list(tags: Iterable[Mapping[str, str]]) -> dict[str, str]:
    return {t["Key"]: t.get("Value", "") for t in tags}


def request_tag_context(tags: Mapping[str, str]) -> dict[str, ContextValue]:
    """aws:RequestTag/<k> for each tag and aws:TagKeys (multivalued); none of them without tags."""
    if not tags:
        return {}
    return {"aws:TagKeys": tuple(tags), **{f"aws:RequestTag/{k}": v for k, v in tags.items()}}


def resource_tag_context(tags: Mapping[str, str], *prefixes: str) -> dict[str, ContextValue]:
    """The resource's current tags as aws:ResourceTag/<k> and the service's own prefix (ec2:ResourceTag/<k>...)."""
    return {f"{prefix}/{k}": v for prefix in ("aws:ResourceTag", *prefixes) for k, v in tags.items()}


_EC2_TYPES = {
    "i-": "instance",
    "vol-": "volume",
    "snap-": "snapshot",
    "sir-": "spot-instances-request",
    "subnet-": "subnet",
    "sg-": "security-group",
    "eni-": "network-interface",
    "ami-": "image",
    "lt-": "launch-template",
    "vpc-": "vpc",
}


def ec2_arn(call: Call, resource_id: str) -> str:
    """The ARN of an EC2 resource by its id; images and snapshots have no account in their ARN."""
    for prefix, kind in _EC2_TYPES.items():
        if resource_id.startswith(prefix):
            account = "" if kind in ("image", "snapshot") else call.account
            return f"arn:aws:ec2:{call.region}:{account}:{kind}/{resource_id}"
    raise UnknownOperation(f"ec2:{call.operation}: no ARN known for the resource id {resource_id!r}")


def _created(call: Call, kind: str) -> str:
    account = "" if kind in ("image", "snapshot") else call.account
    return f"arn:aws:ec2:{call.region}:{account}:{kind}/*"


def _ec2_existing(call: Call, state: State, action: str, resource_id: str, **context: ContextValue) -> Request:
    tags = state.ec2_tags(resource_id)
    return Request(action, ec2_arn(call, resource_id), {**resource_tag_context(tags, "ec2:ResourceTag"), **context})


def _tag_specifications(call: Call) -> dict[str, dict[str, str]]:
    """Tags to write on create, by resource type."""
    found: dict[str, dict[str, str]] = {}
    for spec in call.params.get("TagSpecifications", []) or []:
        found.setdefault(spec["ResourceType"], {}).update(_tag_list(spec.get("Tags", [])))
    return found


def _tags_on_create(call: Call, created: Mapping[str, Mapping[str, str]]) -> list[Request]:
    """ec2:CreateTags for tags written by a create action, on each created resource (ec2:CreateAction)."""
    return [
        Request(
            "ec2:CreateTags", _created(call, kind), {"ec2:CreateAction": call.operation, **request_tag_context(tags)}
        )
        for kind, tags in created.items()
        if tags
    ]


def _ec2_describe(call: Call, state: State) -> list[Request]:
    return [Request(f"ec2:{call.operation}", "*", {})]


def _ec2_create_tags(call: Call, state: State) -> list[Request]:
    tags = _tag_list(call.params.get("Tags", []))
    return [
        _ec2_existing(call, state, "ec2:CreateTags", resource_id, **request_tag_context(tags))
        for resource_id in call.params["Resources"]
    ]


def _ec2_run_instances(call: Call, state: State) -> list[Request]:
    params = call.params
    launch: Mapping[str, Any] = {}
    context: dict[str, ContextValue] = {}
    template_arn = ""
    if "LaunchTemplate" in params:
        spec = params["LaunchTemplate"]
        template_id, launch = state.launch_template(
            spec.get("LaunchTemplateId", ""), spec.get("LaunchTemplateName", ""), str(spec.get("Version", "$Default"))
        )
        template_arn = ec2_arn(call, template_id)
        context["ec2:LaunchTemplate"] = template_arn
        context["ec2:IsLaunchTemplateResource"] = False
    tags = _tag_specifications(call)
    launch_tags = {s["ResourceType"]: _tag_list(s.get("Tags", [])) for s in launch.get("TagSpecifications", [])}
    for kind, values in launch_tags.items():
        tags[kind] = {**values, **tags.get(kind, {})}
    instance_type = params.get("InstanceType") or launch.get("InstanceType", "")
    image = params.get("ImageId") or launch.get("ImageId", "")
    subnet = params.get("SubnetId") or state.subnet_default(launch)
    groups = list(params.get("SecurityGroupIds", []) or launch.get("SecurityGroupIds", []))
    instance_context = {**context, **request_tag_context(tags.get("instance", {}))}
    if instance_type:
        instance_context["ec2:InstanceType"] = instance_type
    requests = [Request("ec2:RunInstances", _created(call, "instance"), instance_context)]
    requests += [Request("ec2:RunInstances", _created(call, "network-interface"), context)]
    requests += [
        Request(
            "ec2:RunInstances", _created(call, "volume"), {**context, **request_tag_context(tags.get("volume", {}))}
        )
    ]
    if template_arn:
        requests.append(Request("ec2:RunInstances", template_arn, context))
    if image:
        requests.append(_ec2_existing(call, state, "ec2:RunInstances", image, **context))
    if subnet:
        requests.append(_ec2_existing(call, state, "ec2:RunInstances", subnet, **context))
    requests += [_ec2_existing(call, state, "ec2:RunInstances", group, **context) for group in groups]
    if (params.get("InstanceMarketOptions") or launch.get("InstanceMarketOptions") or {}).get("MarketType") == "spot":
        requests.append(Request("ec2:RunInstances", _created(call, "spot-instances-request"), context))
    requests += _tags_on_create(call, tags)
    profile = params.get("IamInstanceProfile") or launch.get("IamInstanceProfile")
    for role_arn in state.instance_profile_roles(profile) if profile else ():
        requests.append(Request("iam:PassRole", role_arn, {"iam:PassedToService": "ec2.amazonaws.com"}))
    return requests


def _ec2_create_fleet(call: Call, state: State) -> list[Request]:
    """An instant EC2 Fleet: ec2:CreateFleet on the fleet and its launch template, and each override's launch
    authorized as the caller's RunInstances (EC2 Fleet's IAM prerequisites), its tags with ec2:CreateAction =
    CreateFleet. Every override is checked: EC2, not the caller, picks the one it launches."""
    params = call.params
    spot = (params.get("TargetCapacitySpecification") or {}).get("DefaultTargetCapacityType") == "spot"
    requests = [Request("ec2:CreateFleet", _created(call, "fleet"), {})]
    for config in params.get("LaunchTemplateConfigs", []):
        spec = config["LaunchTemplateSpecification"]
        template_id, _ = state.launch_template(
            spec.get("LaunchTemplateId", ""), spec.get("LaunchTemplateName", ""), str(spec.get("Version", "$Default"))
        )
        requests.append(Request("ec2:CreateFleet", ec2_arn(call, template_id), {}))
        for override in config.get("Overrides") or [{}]:
            launch: dict[str, Any] = {
                "LaunchTemplate": spec,
                "TagSpecifications": params.get("TagSpecifications", []),
                **{key: override[key] for key in ("InstanceType", "SubnetId", "ImageId") if key in override},
            }
            if spot:
                launch["InstanceMarketOptions"] = {"MarketType": "spot"}
            requests += _ec2_run_instances(replace(call, params=launch), state)
    return requests


def _ec2_on_instances(call: Call, state: State) -> list[Request]:
    return [_ec2_existing(call, state, f"ec2:{call.operation}", i) for i in call.params["InstanceIds"]]


def _ec2_cancel_spot(call: Call, state: State) -> list[Request]:
    return [
        _ec2_existing(call, state, "ec2:CancelSpotInstanceRequests", r) for r in call.params["SpotInstanceRequestIds"]
    ]


def _ec2_assign_addresses(call: Call, state: State) -> list[Request]:
    return [_ec2_existing(call, state, "ec2:AssignPrivateIpAddresses", call.params["NetworkInterfaceId"])]


def _ec2_create_volume(call: Call, state: State) -> list[Request]:
    tags = _tag_specifications(call)
    context: dict[str, ContextValue] = {
        **request_tag_context(tags.get("volume", {})),
        "ec2:Encrypted": bool(call.params.get("Encrypted", False)),
        "ec2:VolumeType": call.params.get("VolumeType", "gp2"),
        "ec2:AvailabilityZone": call.params.get("AvailabilityZone", ""),
    }
    requests = [Request("ec2:CreateVolume", _created(call, "volume"), context)]
    if call.params.get("SnapshotId"):
        requests.append(_ec2_existing(call, state, "ec2:CreateVolume", call.params["SnapshotId"], **context))
    return requests + _tags_on_create(call, tags)


def _ec2_volume_and_instance(call: Call, state: State) -> list[Request]:
    action = f"ec2:{call.operation}"
    requests = [_ec2_existing(call, state, action, call.params["VolumeId"])]
    if call.params.get("InstanceId"):
        requests.append(_ec2_existing(call, state, action, call.params["InstanceId"]))
    return requests


def _ec2_delete_volume(call: Call, state: State) -> list[Request]:
    return [_ec2_existing(call, state, "ec2:DeleteVolume", call.params["VolumeId"])]


def _ec2_create_snapshot(call: Call, state: State) -> list[Request]:
    tags = _tag_specifications(call)
    return [
        _ec2_existing(call, state, "ec2:CreateSnapshot", call.params["VolumeId"]),
        Request("ec2:CreateSnapshot", _created(call, "snapshot"), request_tag_context(tags.get("snapshot", {}))),
        *_tags_on_create(call, tags),
    ]


def _ec2_delete_snapshot(call: Call, state: State) -> list[Request]:
    return [_ec2_existing(call, state, "ec2:DeleteSnapshot", call.params["SnapshotId"])]


def _ssm_send_command(call: Call, state: State) -> list[Request]:
    name = call.params["DocumentName"]
    owner = "" if name.startswith("AWS-") else call.account  # AWS-owned documents have no account in their ARN
    document = Request("ssm:SendCommand", f"arn:aws:ssm:{call.region}:{owner}:document/{name}", {})
    instances = [
        Request(
            "ssm:SendCommand",
            ec2_arn(call, instance_id),
            resource_tag_context(state.ec2_tags(instance_id), "ssm:resourceTag"),
        )
        for instance_id in call.params.get("InstanceIds", [])
    ]
    if call.params.get("Targets"):
        raise UnknownOperation("ssm:SendCommand with Targets: its instances are not resolved here")
    return [document, *instances]


def _ssm_instance_information(call: Call, state: State) -> list[Request]:
    """SSM Agent's registration (UpdateInstanceInformation), on the instance it runs on."""
    instance_id = call.params["InstanceId"]
    tags = state.ec2_tags(instance_id)
    return [Request("ssm:UpdateInstanceInformation", ec2_arn(call, instance_id), resource_tag_context(tags))]


def _unscoped(prefix: str) -> Callable[[Call, State], list[Request]]:
    """An action that supports no resource-level permissions: resource "*"."""
    return lambda call, state: [Request(f"{prefix}:{call.operation}", "*", {})]


def _dynamodb(call: Call, state: State) -> list[Request]:
    table = f"arn:aws:dynamodb:{call.region}:{call.account}:table/{call.params['TableName']}"
    index = call.params.get("IndexName")
    return [Request(f"dynamodb:{call.operation}", f"{table}/index/{index}" if index else table, {})]


def _states_machine(call: Call, state: State) -> list[Request]:
    return [Request(f"states:{call.operation}", call.params["stateMachineArn"], {})]


def _states_execution(call: Call, state: State) -> list[Request]:
    return [Request(f"states:{call.operation}", call.params["executionArn"], {})]


def _states_task(call: Call, state: State) -> list[Request]:
    return [Request(f"states:{call.operation}", state.state_machine_of_token(call.params["taskToken"]), {})]


def _sns_publish(call: Call, state: State) -> list[Request]:
    topic = call.params.get("TopicArn") or call.params.get("TargetArn", "")
    requests = [Request("sns:Publish", topic, {})]
    key = state.topic_key(topic)
    if key:  # SNS encrypts the message with the topic's key on the caller's behalf
        via = {"kms:ViaService": f"sns.{call.region}.amazonaws.com"}
        requests += [Request("kms:GenerateDataKey", key, via), Request("kms:Decrypt", key, via)]
    return requests


def _sts_assume_role(call: Call, state: State) -> list[Request]:
    tags = _tag_list(call.params.get("Tags", []) or [])
    role = call.params["RoleArn"]
    context = request_tag_context(tags)
    requests = [Request("sts:AssumeRole", role, context)]
    if tags:
        requests.append(Request("sts:TagSession", role, context))
    return requests


def _lambda_invoke(call: Call, state: State) -> list[Request]:
    name = call.params["FunctionName"]
    arn = name if name.startswith("arn:") else f"arn:aws:lambda:{call.region}:{call.account}:function:{name}"
    return [Request("lambda:InvokeFunction", arn, {})]


def _events_put(call: Call, state: State) -> list[Request]:
    requests = []
    for entry in call.params["Entries"]:
        bus = entry.get("EventBusName") or "default"
        arn = bus if bus.startswith("arn:") else f"arn:aws:events:{call.region}:{call.account}:event-bus/{bus}"
        context = {"events:source": entry.get("Source", ""), "events:detail-type": entry.get("DetailType", "")}
        requests.append(Request("events:PutEvents", arn, context))
    return requests


def _efs_create_access_point(call: Call, state: State) -> list[Request]:
    tags = _tag_list(call.params.get("Tags", []) or [])
    requests = [
        Request(
            "elasticfilesystem:CreateAccessPoint",
            state.file_system_arn(call.params["FileSystemId"]),
            request_tag_context(tags),
        )
    ]
    if tags:
        requests.append(
            Request(
                "elasticfilesystem:TagResource",
                f"arn:aws:elasticfilesystem:{call.region}:{call.account}:access-point/*",
                {"elasticfilesystem:CreateAction": "CreateAccessPoint", **request_tag_context(tags)},
            )
        )
    return requests


def _efs_access_point(call: Call, state: State) -> list[Request]:
    access_point = call.params["AccessPointId"]
    arn = f"arn:aws:elasticfilesystem:{call.region}:{call.account}:access-point/{access_point}"
    return [
        Request(f"elasticfilesystem:{call.operation}", arn, resource_tag_context(state.access_point_tags(access_point)))
    ]


def _ec2_delete_tags(call: Call, state: State) -> list[Request]:
    keys: tuple[str, ...] = tuple(t["Key"] for t in call.params.get("Tags", []) or [])
    return [
        _ec2_existing(call, state, "ec2:DeleteTags", resource_id, **({"aws:TagKeys": keys} if keys else {}))
        for resource_id in call.params["Resources"]
    ]


def _cloudformation_stack(call: Call, state: State) -> list[Request]:
    return [Request(f"cloudformation:{call.operation}", state.stack_arn(call.params.get("StackName", "")), {})]


def _fis_start_experiment(call: Call, state: State) -> list[Request]:
    template = f"arn:aws:fis:{call.region}:{call.account}:experiment-template/{call.params['experimentTemplateId']}"
    experiment = f"arn:aws:fis:{call.region}:{call.account}:experiment/*"
    tags = dict(call.params.get("tags", {}) or {})
    requests = [
        Request("fis:StartExperiment", template, request_tag_context(tags)),
        Request("fis:StartExperiment", experiment, request_tag_context(tags)),
    ]
    if tags:  # tags given at start are written with fis:TagResource on the new experiment
        requests.append(Request("fis:TagResource", experiment, request_tag_context(tags)))
    return requests


def _fis_experiment(call: Call, state: State) -> list[Request]:
    return [
        Request(f"fis:{call.operation}", f"arn:aws:fis:{call.region}:{call.account}:experiment/{call.params['id']}", {})
    ]


def _fis_experiment_template(call: Call, state: State) -> list[Request]:
    template = f"arn:aws:fis:{call.region}:{call.account}:experiment-template/{call.params['id']}"
    return [Request(f"fis:{call.operation}", template, {})]


def _ssm_parameters_by_path(call: Call, state: State) -> list[Request]:
    """The path as a parameter ARN; AWS's public parameters (/aws/...) have no account in theirs."""
    path = call.params["Path"]
    owner = "" if path.startswith("/aws/") else call.account
    return [Request("ssm:GetParametersByPath", f"arn:aws:ssm:{call.region}:{owner}:parameter{path}", {})]


def _iam_role(call: Call, state: State) -> list[Request]:
    return [Request(f"iam:{call.operation}", state.role_arn(call.params["RoleName"]), {})]


def _kms_key(call: Call, state: State) -> list[Request]:
    return [Request(f"kms:{call.operation}", state.kms_key_arn(call.params["KeyId"]), {})]


def _service_quota(call: Call, state: State) -> list[Request]:
    quota = (
        f"arn:aws:servicequotas:{call.region}:{call.account}:{call.params['ServiceCode']}/{call.params['QuotaCode']}"
    )
    return [Request("servicequotas:GetServiceQuota", quota, {})]


def _s3(call: Call, state: State) -> list[Request]:
    """S3 as moto names it (its IAM action and the bucket or object ARN); HeadBucket is authorized as ListBucket."""
    action = {"HeadBucket": "ListBucket", "HeadObject": "GetObject"}.get(call.operation, call.operation)
    context: dict[str, ContextValue] = {}
    if action == "ListBucket" and "prefix" in call.params:
        context["s3:prefix"] = call.params["prefix"]
    if "Keys" in call.params:  # DeleteObjects: each object it deletes
        return [Request(f"s3:{action}", f"{call.params['Resource']}/{key}", context) for key in call.params["Keys"]]
    return [Request(f"s3:{action}", call.params["Resource"], context), *_s3_kms(call, state)]


def _s3_kms(call: Call, state: State) -> list[Request]:
    """SSE-KMS: S3 asks KMS as the caller (Amazon S3 User Guide, "Using server-side encryption with AWS KMS keys"):
    kms:GenerateDataKey for an object it writes with the bucket's default key (the store names none of its own),
    kms:Decrypt for one it reads with the key the object was written with. HeadObject decrypts nothing."""
    bucket_arn, _, key = str(call.params["Resource"]).partition("/")
    bucket = bucket_arn.removeprefix("arn:aws:s3:::")
    if call.operation == "PutObject":
        action, sse = "kms:GenerateDataKey", state.bucket_encryption(bucket)
    elif call.operation == "GetObject":
        action, sse = "kms:Decrypt", state.object_encryption(bucket, key)
    else:
        return []
    if sse is None:
        return []
    context: dict[str, ContextValue] = {
        "kms:ViaService": f"s3.{call.region}.amazonaws.com",
        "kms:CallerAccount": call.account,
        "kms:EncryptionContext:aws:s3:arn": bucket_arn if sse.bucket_key else str(call.params["Resource"]),
    }
    return [Request(action, sse.key_arn, context)]


# (IAM service prefix, operation) -> the requests it makes.
OPERATIONS: dict[tuple[str, str], Callable[[Call, State], list[Request]]] = {
    **{
        ("ec2", name): _ec2_describe
        for name in (
            "DescribeInstances",
            "DescribeInstanceTypes",
            "DescribeSubnets",
            "DescribeVolumes",
            "DescribeSnapshots",
            "DescribeSpotInstanceRequests",
            "DescribeLaunchTemplates",
            "DescribeLaunchTemplateVersions",
            "DescribeImages",
            "DescribeTags",
            "DescribeRouteTables",
            "DescribeVpcEndpoints",
        )
    },
    ("ec2", "GetEbsEncryptionByDefault"): _unscoped("ec2"),
    ("ec2", "GetEbsDefaultKmsKeyId"): _unscoped("ec2"),
    ("ec2", "CreateTags"): _ec2_create_tags,
    ("ec2", "DeleteTags"): _ec2_delete_tags,
    ("ec2", "DescribeSpotPriceHistory"): _ec2_describe,
    ("pricing", "GetProducts"): _unscoped("pricing"),
    ("cloudformation", "DescribeStacks"): _cloudformation_stack,
    ("fis", "StartExperiment"): _fis_start_experiment,
    ("fis", "GetExperiment"): _fis_experiment,
    ("fis", "GetExperimentTemplate"): _fis_experiment_template,
    ("ssm", "GetParametersByPath"): _ssm_parameters_by_path,
    ("iam", "GetRole"): _iam_role,
    ("kms", "DescribeKey"): _kms_key,
    ("servicequotas", "GetServiceQuota"): _service_quota,
    ("lambda", "GetAccountSettings"): _unscoped("lambda"),
    ("ec2", "RunInstances"): _ec2_run_instances,
    ("ec2", "CreateFleet"): _ec2_create_fleet,
    ("ec2", "TerminateInstances"): _ec2_on_instances,
    ("ec2", "AssignPrivateIpAddresses"): _ec2_assign_addresses,
    ("ec2", "SendSpotInstanceInterruptions"): _ec2_on_instances,  # FIS's aws:ec2:send-spot-instance-interruptions
    ("ec2", "StopInstances"): _ec2_on_instances,
    ("ec2", "CancelSpotInstanceRequests"): _ec2_cancel_spot,
    ("ec2", "CreateVolume"): _ec2_create_volume,
    ("ec2", "AttachVolume"): _ec2_volume_and_instance,
    ("ec2", "DetachVolume"): _ec2_volume_and_instance,
    ("ec2", "DeleteVolume"): _ec2_delete_volume,
    ("ec2", "CreateSnapshot"): _ec2_create_snapshot,
    ("ec2", "DeleteSnapshot"): _ec2_delete_snapshot,
    ("ssm", "SendCommand"): _ssm_send_command,
    ("ssm", "UpdateInstanceInformation"): _ssm_instance_information,
    **{
        ("ssm", name): _unscoped("ssm")
        for name in ("GetCommandInvocation", "ListCommands", "ListCommandInvocations", "DescribeInstanceInformation")
    },
    **{
        ("dynamodb", name): _dynamodb
        for name in ("GetItem", "PutItem", "UpdateItem", "DeleteItem", "Query", "Scan", "DescribeTable")
    },
    ("states", "StartExecution"): _states_machine,
    ("states", "ListExecutions"): _states_machine,
    ("states", "DescribeStateMachine"): _states_machine,
    ("states", "DescribeExecution"): _states_execution,
    ("states", "StopExecution"): _states_execution,
    ("states", "GetExecutionHistory"): _states_execution,
    ("states", "SendTaskSuccess"): _states_task,
    ("states", "SendTaskFailure"): _states_task,
    ("states", "SendTaskHeartbeat"): _states_task,
    ("sns", "Publish"): _sns_publish,
    ("sts", "AssumeRole"): _sts_assume_role,
    ("sts", "GetCallerIdentity"): lambda call, state: [],  # needs no permission (IAM User Guide)
    ("lambda", "Invoke"): _lambda_invoke,
    ("events", "PutEvents"): _events_put,
    ("elasticfilesystem", "CreateAccessPoint"): _efs_create_access_point,
    ("elasticfilesystem", "DescribeAccessPoints"): _efs_access_point,
    ("elasticfilesystem", "DeleteAccessPoint"): _efs_access_point,
    **{
        ("s3", name): _s3
        for name in ("GetObject", "PutObject", "DeleteObject", "ListBucket", "HeadBucket", "HeadObject")
    },
}


def requests_for(call: Call, state: State) -> list[Request]:
    """The IAM requests `call` makes; UnknownOperation when it has no entry."""
    build = OPERATIONS.get((call.service, call.operation))
    if build is None:
        raise UnknownOperation(
            f"{call.service}:{call.operation} has no entry in rehearsal/iam/requests.py: add the requests AWS "
            "evaluates for it (Service Authorization Reference)"
        )
    return build(call, state)


def function_url(function_arn: str, auth_type: str, resource_policy: Mapping[str, Any] | None) -> list[Request]:
    """What Lambda authorizes on a request to a function URL: lambda:InvokeFunctionUrl with the URL's auth type, and
    (for function URLs created from October 2025 on) lambda:InvokeFunction with lambda:InvokedViaFunctionUrl; both
    against the function's own policy (its Lambda permissions) too."""
    return [
        Request("lambda:InvokeFunctionUrl", function_arn, {"lambda:FunctionUrlAuthType": auth_type}, resource_policy),
        Request("lambda:InvokeFunction", function_arn, {"lambda:InvokedViaFunctionUrl": True}, resource_policy),
    ]


def api_invoke(method_arn: str, source_vpce: str, resource_policy: Mapping[str, Any] | None) -> list[Request]:
    """What API Gateway authorizes on an AWS_IAM method of a private API reached through the VPC endpoint
    `source_vpce`: execute-api:Invoke on the method's ARN, against the API's resource policy too."""
    return [Request("execute-api:Invoke", method_arn, {"aws:SourceVpce": source_vpce}, resource_policy)]
