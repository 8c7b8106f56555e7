"""The AWS calls the logic makes besides the registry: EC2, SSM Run Command, Step Functions, SNS, STS, EFS. Clients
are lazy."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from botocore.config import Config
from botocore.exceptions import ClientError
from spotcr_contracts import commands
from spotcr_contracts.commands import Command, FinalDumpOrder

from spotcr_functions.gpus import Gpus, from_gpu_info

# RunInstances and CreateFleet errors that concern this candidate only (type, subnet, market): try the next one.
# Names from the EC2 API error-code reference; tests/events/run-instances-errors.json holds each with its meaning.
CAPACITY_ERRORS = frozenset(
    {
        "InsufficientInstanceCapacity",
        "SpotMaxPriceTooLow",
        "MaxSpotInstanceCountExceeded",
        "Unsupported",
        "InsufficientCapacity",
        "InsufficientHostCapacity",
        "InvalidParameterValue",  # e.g. a fallback type of another architecture than the AMI
        "InvalidParameterCombination",  # e.g. a type that does not support the template's options or the AMI
        "VcpuLimitExceeded",
        "InsufficientFreeAddressesInSubnet",
        "AuthFailure.ServiceLinkedRoleCreationNotPermitted",  # no AWSServiceRoleForEC2Spot: on-demand still works
    }
)
# Instance states in which nothing of the job can run: a stopped instance runs no process until started again.
NOT_RUNNING_STATES = frozenset({"stopped", "terminated"})
VOLUME_WAIT_SECONDS = 60  # the volume_available waiter below: 2 s x 30 attempts
# SendTaskSuccess/Failure on a token that is finished already: the other side of the rendezvous won.
FINISHED_TOKEN_ERRORS = frozenset({"TaskTimedOut", "InvalidToken", "TaskDoesNotExist"})


@dataclass(frozen=True)
class Instance:
    instance_id: str
    state: str
    instance_type: str
    az: str
    subnet_id: str
    vpc_id: str
    tags: Mapping[str, str]
    spot_request_id: str = ""
    launched_at: str = ""  # ISO time of the last start: a stopped instance started again gets a new one
    image_id: str = ""
    # The private addresses of its primary network interface, the primary one first: a job over several VMs takes
    # a node's address from them (jobs.node_address).
    private_ips: tuple[str, ...] = ()
    interface_id: str = ""  # its primary network interface, which a node's address moves to


def _primary_interface(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    for interface in raw.get("NetworkInterfaces", []):
        if interface.get("Attachment", {}).get("DeviceIndex", 0) == 0:
            return interface
    return {}


def _primary_interface_ips(raw: Mapping[str, Any]) -> tuple[str, ...]:
    if interface := _primary_interface(raw):
        found = sorted(interface.get("PrivateIpAddresses", []), key=lambda a: not a.get("Primary"))
        return tuple(str(a["PrivateIpAddress"]) for a in found)
    return (str(raw["PrivateIpAddress"]),) if raw.get("PrivateIpAddress") else ()


def _iso(value: Any) -> str:
    """boto3 parses LaunchTime into an aware datetime; the record keeps ISO text."""
    return value.isoformat().replace("+00:00", "Z") if hasattr(value, "isoformat") else str(value or "")


# Every client the functions make. botocore's standard mode: throttles (RequestLimitExceeded, ThrottlingException,
# ProvisionedThroughputExceededException, TooManyRequestsException) are retried with full-jitter exponential backoff
# (1 s base, as AWS's "Retry behavior" guide recommends), behind a retry quota that stops a retry storm. Not adaptive:
# its client-side rate limiter only sees this execution environment's calls, a sliver of the account's in a wave.
# 5 attempts: at most 1 + 2 + 4 + 8 = 15 s of backoff, half the default function timeout; a throttle that outlasts
# them becomes `Throttled`, which the state machine's Retry waits out, or Lambda's asynchronous retries do.
CLIENT_CONFIG = Config(retries={"mode": "standard", "total_max_attempts": 5})
# The final-dump SendCommand: one attempt. A throttled sender puts its orders back in the outbox, where the next
# sender takes them with its own into one command (final_dumps): a retry of the same command would only wait.
ONCE_CONFIG = Config(retries={"mode": "standard", "total_max_attempts": 1})
# Codes AWS answers a call over its rate with (the EC2, SSM/Step Functions/EventBridge, DynamoDB and Lambda ones).
THROTTLING_ERRORS = frozenset(
    {
        "RequestLimitExceeded",
        "ThrottlingException",
        "Throttling",
        "ProvisionedThroughputExceededException",
        "TooManyRequestsException",
        "RequestThrottled",
    }
)


class Throttled(Exception):
    """An AWS API refused a call for its rate after the SDK's retries. Named so: the state machine retries it."""


def error_code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


def is_throttle(error: ClientError) -> bool:
    return error_code(error) in THROTTLING_ERRORS


class Cloud:
    def __init__(self, session: Any = None) -> None:
        self._session = session

    def _client(self, service: str, config: Config = CLIENT_CONFIG) -> Any:
        import boto3

        return (self._session or boto3).client(service, config=config)

    @cached_property
    def ec2(self) -> Any:
        return self._client("ec2")

    @cached_property
    def ssm(self) -> Any:
        return self._client("ssm")

    @cached_property
    def ssm_once(self) -> Any:
        return self._client("ssm", ONCE_CONFIG)

    @cached_property
    def sfn(self) -> Any:
        return self._client("stepfunctions")

    @cached_property
    def sns(self) -> Any:
        return self._client("sns")

    @cached_property
    def sts(self) -> Any:
        return self._client("sts")

    @cached_property
    def efs(self) -> Any:
        return self._client("efs")

    def create_access_point(self, file_system_id: str, root: str, tags: Mapping[str, str], client_token: str) -> str:
        """An access point whose root directory EFS creates (root-owned, 0700) on first mount; its ARN."""
        try:
            response = self.efs.create_access_point(
                ClientToken=client_token,
                FileSystemId=file_system_id,
                RootDirectory={"Path": root, "CreationInfo": {"OwnerUid": 0, "OwnerGid": 0, "Permissions": "0700"}},
                Tags=[{"Key": key, "Value": value} for key, value in tags.items() if value],
            )
        except ClientError as error:
            # A retry with the same ClientToken: AccessPointAlreadyExists names the access point made the first time.
            existing = error.response.get("AccessPointId") or error.response.get("Error", {}).get("AccessPointId")
            if error_code(error) != "AccessPointAlreadyExists" or not existing:
                raise
            return str(self.efs.describe_access_points(AccessPointId=existing)["AccessPoints"][0]["AccessPointArn"])
        return str(response["AccessPointArn"])

    def delete_access_point(self, access_point_arn: str) -> None:
        try:
            self.efs.delete_access_point(AccessPointId=access_point_arn.rsplit("/", 1)[-1])
        except ClientError as error:
            if error_code(error) != "AccessPointNotFound":
                raise

    def assume_store_role(
        self,
        role_arn: str,
        session_name: str,
        policy: Mapping[str, Any],
        session_tags: Mapping[str, str],
        duration_s: int,
    ) -> dict[str, Any]:
        """Temporary credentials of the store role, narrowed by a session policy and session tags."""
        response = self.sts.assume_role(
            RoleArn=role_arn,
            RoleSessionName=session_name,
            Policy=json.dumps(policy, separators=(",", ":")),
            Tags=[{"Key": key, "Value": value} for key, value in session_tags.items()],
            DurationSeconds=duration_s,
        )
        return dict(response["Credentials"])

    def notify(self, topic_arn: str, subject: str, message: str) -> None:
        self.sns.publish(TopicArn=topic_arn, Subject=subject[:100], Message=message)

    def describe_instance(self, instance_id: str) -> Instance | None:
        # By filter, not InstanceIds: EC2 takes a filtered Describe from the non-mutating bucket (100, 20 a second),
        # an unfiltered one from the smaller one (50, 10 a second), which a wave of recoveries empties first.
        # An unknown or malformed id then matches nothing (None), as its InvalidInstanceID error said before.
        reservations = self.ec2.describe_instances(Filters=[{"Name": "instance-id", "Values": [instance_id]}])
        for reservation in reservations["Reservations"]:
            for raw in reservation["Instances"]:
                return Instance(
                    instance_id=raw["InstanceId"],
                    state=raw["State"]["Name"],
                    instance_type=raw["InstanceType"],
                    az=raw["Placement"]["AvailabilityZone"],
                    subnet_id=raw.get("SubnetId", ""),
                    vpc_id=raw.get("VpcId", ""),
                    tags={t["Key"]: t["Value"] for t in raw.get("Tags", [])},
                    spot_request_id=raw.get("SpotInstanceRequestId", ""),
                    launched_at=_iso(raw.get("LaunchTime")),
                    image_id=raw.get("ImageId", ""),
                    private_ips=_primary_interface_ips(raw),
                    interface_id=str(_primary_interface(raw).get("NetworkInterfaceId") or ""),
                )
        return None

    def move_private_address(self, interface_id: str, address: str) -> None:
        """Make `address` a secondary private address of this network interface, taking it from any interface of the
        subnet that holds it (AllowReassignment): a node's address moving to its backup. EC2 refuses an address
        outside the interface's subnet."""
        self.ec2.assign_private_ip_addresses(
            NetworkInterfaceId=interface_id, PrivateIpAddresses=[address], AllowReassignment=True
        )

    def tag_instance(self, instance_id: str, tags: Mapping[str, str]) -> None:
        self.ec2.create_tags(Resources=[instance_id], Tags=[{"Key": k, "Value": v} for k, v in tags.items()])

    def instance_gpus(self, instance_types: Sequence[str]) -> dict[str, Gpus | None]:
        """The GPUs of each instance type EC2 knows (None: no GPU); a type it does not know is left out."""
        found: dict[str, Gpus | None] = {}
        for batch in (list(instance_types), *([t] for t in instance_types)):
            try:
                # Named types come back in one page (a job names far fewer than the 100 a call may ask for).
                for raw in self.ec2.describe_instance_types(InstanceTypes=batch)["InstanceTypes"]:
                    found[raw["InstanceType"]] = from_gpu_info(raw.get("GpuInfo"))
            except ClientError as error:
                if error_code(error) != "InvalidInstanceType":
                    raise
                continue  # one unknown type fails the whole call: ask for each type alone
            if len(found) == len(set(instance_types)):
                break
        return found

    def subnets(self, subnet_ids: Sequence[str]) -> list[tuple[str, str]]:
        """(subnet id, AZ) of these subnets, in the order given."""
        response = self.ec2.describe_subnets(SubnetIds=list(subnet_ids))
        zones = {s["SubnetId"]: s["AvailabilityZone"] for s in response["Subnets"]}
        return [(subnet_id, zones[subnet_id]) for subnet_id in subnet_ids if subnet_id in zones]

    def run_instance(
        self,
        *,
        launch_template: tuple[str, str],
        instance_type: str,
        subnet_id: str,
        image_id: str,
        tags: Mapping[str, str],
        client_token: str,
    ) -> Instance:
        """One on-demand instance from this (template id, version); image_id ("": the template's) overrides."""
        template_id, version = launch_template
        arguments: dict[str, Any] = {
            "LaunchTemplate": {"LaunchTemplateId": template_id, "Version": version},
            "InstanceType": instance_type,
            "SubnetId": subnet_id,
            "MinCount": 1,
            "MaxCount": 1,
            "ClientToken": client_token,
            "TagSpecifications": [
                {"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}
            ],
        }
        if image_id:
            arguments["ImageId"] = image_id
        raw = self.ec2.run_instances(**arguments)["Instances"][0]
        return Instance(
            instance_id=raw["InstanceId"],
            state=raw["State"]["Name"],
            instance_type=raw["InstanceType"],
            az=raw["Placement"]["AvailabilityZone"],
            subnet_id=raw.get("SubnetId", subnet_id),
            vpc_id=raw.get("VpcId", ""),
            tags=dict(tags),
            image_id=raw.get("ImageId", image_id),
        )

    def launch_spot(
        self,
        *,
        launch_template: tuple[str, str],
        overrides: Sequence[Mapping[str, str]],
        image_id: str,
        tags: Mapping[str, str],
        client_token: str,
    ) -> tuple[Instance | None, list[tuple[str, str]]]:
        """One spot instance from an instant EC2 Fleet over these overrides (instance_type, subnet_id, az), as AWS
        recommends: EC2 picks the pool (price-capacity-optimized). Returns the instance (None: none launched) and
        the (code, message) of each error the fleet reports: an instant fleet reports no capacity there, not as a
        failed call."""
        template_id, version = launch_template
        image = {"ImageId": image_id} if image_id else {}
        response = self.ec2.create_fleet(
            Type="instant",
            ClientToken=client_token,
            TargetCapacitySpecification={"TotalTargetCapacity": 1, "DefaultTargetCapacityType": "spot"},
            SpotOptions={"AllocationStrategy": "price-capacity-optimized", "InstanceInterruptionBehavior": "terminate"},
            LaunchTemplateConfigs=[
                {
                    "LaunchTemplateSpecification": {"LaunchTemplateId": template_id, "Version": version},
                    "Overrides": [
                        {"InstanceType": o["instance_type"], "SubnetId": o["subnet_id"], **image} for o in overrides
                    ],
                }
            ],
            TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}],
        )
        errors = [(str(e.get("ErrorCode", "")), str(e.get("ErrorMessage", ""))) for e in response.get("Errors", [])]
        for launched in response.get("Instances", []):
            chosen = launched.get("LaunchTemplateAndOverrides", {}).get("Overrides", {})
            # The zone comes from the override chosen: a new instance may not be describable yet.
            override = next((o for o in overrides if o["subnet_id"] == chosen.get("SubnetId")), overrides[0])
            for instance_id in launched.get("InstanceIds", []):
                return Instance(
                    instance_id=instance_id,
                    state="pending",
                    instance_type=str(launched.get("InstanceType") or override["instance_type"]),
                    az=override["az"],
                    subnet_id=override["subnet_id"],
                    vpc_id="",
                    tags=dict(tags),
                    image_id=image_id,
                ), errors
        return None, errors

    def image_exists(self, image_id: str) -> bool:
        """The AMI can still launch instances (False once deregistered)."""
        try:
            images = self.ec2.describe_images(ImageIds=[image_id])["Images"]
        except ClientError as error:
            if error_code(error).startswith("InvalidAMIID"):
                return False
            raise
        return any(image.get("State") == "available" for image in images)

    def terminate_instance(self, instance_id: str) -> None:
        try:
            self.ec2.terminate_instances(InstanceIds=[instance_id])
        except ClientError as error:
            if not error_code(error).startswith("InvalidInstanceID"):
                raise

    def cancel_spot_request(self, request_id: str) -> None:
        """A persistent request relaunches or restarts its instance when capacity returns; cancel it first."""
        try:
            self.ec2.cancel_spot_instance_requests(SpotInstanceRequestIds=[request_id])
        except ClientError as error:
            if not error_code(error).startswith("InvalidSpotInstanceRequestID"):
                raise

    def delete_volume(self, volume_id: str) -> bool:
        """Delete a job volume; False while it is still attached (VolumeInUse). A missing one counts as deleted."""
        try:
            self.ec2.delete_volume(VolumeId=volume_id)
        except ClientError as error:
            code = error_code(error)
            if code == "VolumeInUse":
                return False
            if not code.startswith("InvalidVolume.NotFound"):
                raise
        return True

    def delete_snapshot(self, snapshot_id: str) -> None:
        try:
            self.ec2.delete_snapshot(SnapshotId=snapshot_id)
        except ClientError as error:
            if not error_code(error).startswith("InvalidSnapshot.NotFound"):
                raise

    def volume(self, volume_id: str) -> dict[str, Any] | None:
        # By filter, as describe_instance: the larger bucket; an unknown volume matches nothing.
        volumes = self.ec2.describe_volumes(Filters=[{"Name": "volume-id", "Values": [volume_id]}])["Volumes"]
        return volumes[0] if volumes else None

    def create_volume(
        self, az: str, size_gib: int, tags: Mapping[str, str], client_token: str, snapshot_id: str = ""
    ) -> str:
        arguments: dict[str, Any] = {
            "AvailabilityZone": az,
            "VolumeType": "gp3",
            "Encrypted": True,
            "ClientToken": client_token,
            "TagSpecifications": [
                {"ResourceType": "volume", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}
            ],
        }
        if snapshot_id:
            arguments["SnapshotId"] = snapshot_id
        else:
            arguments["Size"] = size_gib
        return str(self.ec2.create_volume(**arguments)["VolumeId"])

    def wait_volume_available(self, volume_id: str) -> None:
        self.ec2.get_waiter("volume_available").wait(
            VolumeIds=[volume_id], WaiterConfig={"Delay": 2, "MaxAttempts": VOLUME_WAIT_SECONDS // 2}
        )

    def attach_volume(self, volume_id: str, instance_id: str) -> None:
        self.ec2.attach_volume(VolumeId=volume_id, InstanceId=instance_id, Device="/dev/sdf")

    def detach_volume(self, volume_id: str, instance_id: str) -> None:
        self.ec2.detach_volume(VolumeId=volume_id, InstanceId=instance_id)

    def create_snapshot(self, volume_id: str, tags: Mapping[str, str]) -> str:
        response = self.ec2.create_snapshot(
            VolumeId=volume_id,
            Description="spotcr: move the job's volume to the backup's AZ",
            TagSpecifications=[{"ResourceType": "snapshot", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}],
        )
        return str(response["SnapshotId"])

    def snapshot_state(self, snapshot_id: str) -> str:
        return str(self.ec2.describe_snapshots(SnapshotIds=[snapshot_id])["Snapshots"][0]["State"])

    def send_command(self, document_name: str, command: Command, instance_id: str, values: Mapping[str, str]) -> str:
        """SSM Run Command with typed parameters, checked against the contract before sending."""
        command.agent_argv(values)
        response = self.ssm.send_command(
            InstanceIds=[instance_id],
            DocumentName=document_name,
            Parameters={k: [v] for k, v in values.items()},
            Comment=f"spotcr {command.name}",
        )
        return str(response["Command"]["CommandId"])

    def send_final_dumps(self, document_name: str, orders: Sequence[FinalDumpOrder]) -> str:
        """One FINAL_DUMP command to the orders' instances (commands.order_batches sizes it), tried once
        (ONCE_CONFIG)."""
        orders_value = commands.orders_value(orders)
        commands.FINAL_DUMP.agent_argv({"Orders": orders_value})
        response = self.ssm_once.send_command(
            InstanceIds=[order.instance_id for order in orders],
            DocumentName=document_name,
            Parameters={"Orders": [orders_value]},
            Comment=f"spotcr {commands.FINAL_DUMP.name}",
        )
        return str(response["Command"]["CommandId"])

    def command_invocation(self, command_id: str, instance_id: str) -> dict[str, Any] | None:
        """What SSM says of the command on that instance (Status, StandardOutputContent, ...): the output only that
        instance's SSM Agent can report. None when SSM has no such invocation."""
        try:
            return dict(self.ssm.get_command_invocation(CommandId=command_id, InstanceId=instance_id))
        except ClientError as error:
            if error_code(error) in ("InvocationDoesNotExist", "InvalidCommandId", "InvalidInstanceId"):
                return None
            raise

    def start_recovery(self, state_machine_arn: str, name: str, payload: Mapping[str, Any]) -> bool:
        """Start the recovery workflow under a deterministic name; False when it already runs or ran."""
        try:
            self.sfn.start_execution(
                stateMachineArn=state_machine_arn, name=name, input=json.dumps(payload, sort_keys=True)
            )
        except ClientError as error:
            if error_code(error) == "ExecutionAlreadyExists":
                return False
            raise
        return True

    def complete_task(self, token: str, output: Mapping[str, Any] | None, error: str = "", cause: str = "") -> bool:
        """Resume a waiting workflow step; False when the token was completed or timed out already."""
        try:
            if error:
                self.sfn.send_task_failure(taskToken=token, error=error, cause=cause[:32768])
            else:
                self.sfn.send_task_success(taskToken=token, output=json.dumps(output or {}))
        except ClientError as error_:
            if error_code(error_) in FINISHED_TOKEN_ERRORS:
                return False
            raise
        return True
