"""The rehearsal's leak check: what a finished job may leave (its checkpoints, the user's instance) and what not."""

import boto3
import pytest
from moto import mock_aws
from moto.ssm.models import ssm_backends

from rehearsal import leaks

pytestmark = pytest.mark.claim("Nothing left allocated")

REGION = "us-east-1"


@pytest.fixture
def account(monkeypatch):
    environment = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": REGION}
    environment["MOTO_EC2_LOAD_DEFAULT_AMIS"] = "false"  # as in the local cloud: only the job image
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    with mock_aws():
        yield lambda service: boto3.client(service, region_name=REGION)


def _image(client):
    return client("ec2").register_image(Name="job-vm", Architecture="x86_64")["ImageId"]


def _launch(client, image_id, tags):
    spec = [{"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}]
    reservation = client("ec2").run_instances(ImageId=image_id, MinCount=1, MaxCount=1, TagSpecifications=spec)
    return reservation["Instances"][0]["InstanceId"]


def test_a_tidy_account_has_no_leaks(account):
    # Given the job image, the user's own instance, a terminated backup and checkpoints in S3
    image_id = _image(account)
    _launch(account, image_id, {"spotcr:job": "sim"})
    backup = _launch(account, image_id, {"spotcr:job": "sim", "spotcr:mode": "restore"})
    account("ec2").terminate_instances(InstanceIds=[backup])
    account("s3").create_bucket(Bucket="checkpoints")
    account("s3").put_object(Bucket="checkpoints", Key="jobs/sim/manifest.json", Body=b"{}")
    # Then nothing counts as left over
    assert leaks.find_leaks(account) == []


def test_each_leftover_is_named(account):
    # Given a running backup, a job volume, a snapshot of it and a command still in progress
    image_id = _image(account)
    ec2 = account("ec2")
    backup = _launch(account, image_id, {"spotcr:job": "sim", "spotcr:mode": "restore"})
    tags = [{"ResourceType": "volume", "Tags": [{"Key": "spotcr:job", "Value": "sim"}]}]
    volume = ec2.create_volume(AvailabilityZone=f"{REGION}a", Size=1, TagSpecifications=tags)["VolumeId"]
    snapshot = ec2.create_snapshot(VolumeId=volume)["SnapshotId"]
    document = account("ssm").create_document(
        Name="spotcr-status",
        DocumentType="Command",
        Content='{"schemaVersion": "2.2", "description": "x", "mainSteps": []}',
    )["DocumentDescription"]["Name"]
    command_id = account("ssm").send_command(InstanceIds=[backup], DocumentName=document)["Command"]["CommandId"]
    for command in ssm_backends["123456789012"][REGION]._commands:
        command.status = "InProgress"
    # Then the check lists each of them with what it is
    found = {(leak.kind, leak.resource_id): leak.detail for leak in leaks.find_leaks(account)}
    assert found[("instance", backup)] == "running backup of job sim"
    assert found[("volume", volume)].endswith("job sim")
    assert found[("snapshot", snapshot)].startswith(f"of {volume}")
    assert found[("command", command_id)] == "spotcr-status still InProgress"
    assert len(found) == 4


def test_an_access_point_left_on_efs_is_named_and_the_files_are_not(account):
    # Given the stack's EFS with the access point of a job that ended but was not tidied, and one deleted
    efs = account("efs")
    file_system = efs.create_file_system(CreationToken="spotcr")["FileSystemId"]
    tags = [{"Key": "spotcr:job", "Value": "sim"}]
    left = efs.create_access_point(FileSystemId=file_system, Tags=tags, RootDirectory={"Path": "/jobs/sim"})
    gone = efs.create_access_point(FileSystemId=file_system, Tags=tags, RootDirectory={"Path": "/jobs/sim"})
    efs.delete_access_point(AccessPointId=gone["AccessPointId"])
    # Then the check names the one left, where it points and whose it is; the file system itself is kept
    found = {(leak.kind, leak.resource_id): leak.detail for leak in leaks.find_leaks(account)}
    assert found == {("access-point", left["AccessPointId"]): f"on {file_system} at /jobs/sim, job sim"}


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_the_check_waits_for_cleanup_before_naming_leftovers():
    # Given a cleanup that finishes on the third look
    running = [leaks.Leak("instance", "i-1", "running backup of job sim")]
    answers = iter([running, running, []])
    clock = Clock()
    # Then the check passes, two polls later
    tidy = leaks.wait_until_tidy(lambda s: None, 10, clock=clock, sleep=clock.sleep, find=lambda _: next(answers))
    assert tidy == [] and clock.now == 2.0
    # And a leftover that stays past the grace period is named
    left = leaks.wait_until_tidy(lambda s: None, 5, clock=clock, sleep=clock.sleep, find=lambda _: running)
    assert left == running and clock.now == 7.0
    assert "instance i-1: running backup of job sim" in leaks.describe(left)
