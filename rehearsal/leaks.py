"""The leak check that ends every end-to-end run: nothing stays allocated but what the job keeps.

A finished job keeps its checkpoints (objects in the checkpoint bucket, files on EFS) and the instance
the user launched. Everything spotcr allocated must be gone: backup instances it launched (spotcr:mode
set), volumes (the job's EBS volume, volumes made by a cross-AZ move), snapshots (but those behind the
job image), EFS access points (one per efs job), and SSM commands still pending or in progress.
Cleanup is asynchronous (events, the workflow), so the check waits a grace period before it names
what is left.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spotcr_contracts import tags

GONE_STATES = {"shutting-down", "terminated"}
OPEN_COMMAND_STATES = {"Pending", "InProgress", "Delayed", "Cancelling"}


@dataclass(frozen=True)
class Leak:
    kind: str  # instance, volume, snapshot, access-point, command
    resource_id: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} {self.resource_id}: {self.detail}"


def find_leaks(client: Callable[[str], Any]) -> list[Leak]:
    """What is left now in the (local) account: `client(service)` is a boto3 client factory."""
    ec2, ssm = client("ec2"), client("ssm")
    leaks: list[Leak] = []
    root_volumes: set[str] = set()
    for reservation in ec2.describe_instances()["Reservations"]:
        for instance in reservation["Instances"]:
            state = instance["State"]["Name"]
            for mapping in instance.get("BlockDeviceMappings", []):
                if mapping.get("DeviceName") == instance.get("RootDeviceName") and "Ebs" in mapping:
                    root_volumes.add(mapping["Ebs"]["VolumeId"])
            labels = {tag["Key"]: tag["Value"] for tag in instance.get("Tags", [])}
            if state in GONE_STATES or tags.MODE not in labels:
                continue  # terminated, or the user's own instance
            leaks.append(Leak("instance", instance["InstanceId"], f"{state} backup of job {labels.get(tags.JOB, '?')}"))
    for volume in ec2.describe_volumes()["Volumes"]:
        if volume["VolumeId"] in root_volumes and volume["State"] != "available":
            continue  # a root volume goes with its instance (DeleteOnTermination)
        labels = {tag["Key"]: tag["Value"] for tag in volume.get("Tags", [])}
        attached = ", ".join(a["InstanceId"] for a in volume.get("Attachments", [])) or "not attached"
        leaks.append(
            Leak("volume", volume["VolumeId"], f"{volume['State']}, {attached}, job {labels.get(tags.JOB, '?')}")
        )
    image_snapshots = {
        mapping["Ebs"]["SnapshotId"]
        for image in ec2.describe_images(Owners=["self"])["Images"]
        for mapping in image.get("BlockDeviceMappings", [])
        if "SnapshotId" in mapping.get("Ebs", {})
    }
    for snapshot in ec2.describe_snapshots(OwnerIds=["self"])["Snapshots"]:
        if snapshot["SnapshotId"] in image_snapshots:
            continue  # backs the job image (the AMI), which the stack keeps
        labels = {tag["Key"]: tag["Value"] for tag in snapshot.get("Tags", [])}
        leaks.append(
            Leak("snapshot", snapshot["SnapshotId"], f"of {snapshot['VolumeId']}, job {labels.get(tags.JOB, '?')}")
        )
    leaks += _access_points(client("efs"))
    for command in ssm.list_commands()["Commands"]:
        if command["Status"] in OPEN_COMMAND_STATES:
            leaks.append(Leak("command", command["CommandId"], f"{command['DocumentName']} still {command['Status']}"))
    return leaks


def _access_points(efs: Any) -> list[Leak]:
    """Every access point of every file system: each belongs to a job that has not ended, or leaked."""
    found = []
    for file_system in efs.describe_file_systems()["FileSystems"]:
        points = efs.describe_access_points(FileSystemId=file_system["FileSystemId"])["AccessPoints"]
        for point in points:
            labels = {tag["Key"]: tag["Value"] for tag in point.get("Tags", [])}
            root = point.get("RootDirectory", {}).get("Path", "/")
            detail = f"on {file_system['FileSystemId']} at {root}, job {labels.get(tags.JOB, '?')}"
            found.append(Leak("access-point", point["AccessPointId"], detail))
    return found


def wait_until_tidy(
    client: Callable[[str], Any],
    grace_s: float,
    *,
    poll_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    find: Callable[[Callable[[str], Any]], list[Leak]] = find_leaks,
) -> list[Leak]:
    """The leaks still there after `grace_s`; empty as soon as nothing is left."""
    deadline = clock() + grace_s
    while True:
        leaks = find(client)
        if not leaks or clock() >= deadline:
            return leaks
        sleep(poll_s)


def describe(leaks: list[Leak]) -> str:
    return f"leak check: {len(leaks)} resource(s) left after the job finished:\n" + "\n".join(
        f"  - {leak}" for leak in leaks
    )
