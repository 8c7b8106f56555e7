"""The local EC2 reads a resource's tags from its own entry, and answers exactly as moto's scan of every tag does."""

from __future__ import annotations

import contextlib
from typing import Any

import boto3
from moto import mock_aws

from rehearsal.localaws import ACCOUNT, REGION, ec2_tags


def _listings(ec2: Any, backend: Any, resources: dict[str, Any]) -> dict[str, Any]:
    """Each resource's tags as moto's models give them, and the listings that read them."""
    models = [backend.get_instance(i) for i in resources["instances"]]
    models += [backend.get_volume(resources["volume"]), backend.get_subnet(resources["subnet"])]
    return {
        "get_tags": [model.get_tags() for model in models],
        "instances": ec2.describe_instances()["Reservations"],
        "filtered": ec2.describe_instances(Filters=[{"Name": "tag:spotcr:job", "Values": ["j"]}])["Reservations"],
        "volumes": ec2.describe_volumes()["Volumes"],
        "subnets": ec2.describe_subnets(SubnetIds=[resources["subnet"]])["Subnets"],
    }


def test_a_resources_tags_are_the_same_as_motos_scan_gives_them():
    from moto.ec2.models import ec2_backends

    with mock_aws():
        # Given tagged instances (one untagged, one whose tags were deleted), a tagged volume and subnet
        ec2 = boto3.client("ec2", region_name=REGION)
        vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
        subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.1.0/24")["Subnet"]["SubnetId"]
        image = ec2.describe_images()["Images"][0]["ImageId"]
        job_tags = [{"Key": "spotcr:job", "Value": "j"}, {"Key": "b", "Value": ""}]
        tagged = [{"ResourceType": "instance", "Tags": job_tags}]
        launched = ec2.run_instances(ImageId=image, MinCount=3, MaxCount=3, SubnetId=subnet, TagSpecifications=tagged)
        ids = [i["InstanceId"] for i in launched["Instances"]]
        ids += [i["InstanceId"] for i in ec2.run_instances(ImageId=image, MinCount=1, MaxCount=1)["Instances"]]
        volume = ec2.create_volume(AvailabilityZone=f"{REGION}a", Size=1)["VolumeId"]
        ec2.create_tags(Resources=[volume, subnet, ids[1]], Tags=[{"Key": "a", "Value": "1"}])
        ec2.delete_tags(Resources=[ids[2]], Tags=[{"Key": "spotcr:job"}, {"Key": "b"}])
        resources = {"instances": ids, "volume": volume, "subnet": subnet}
        backend = ec2_backends[ACCOUNT][REGION]
        # When they are read with the tags taken from each resource's own entry, and then by moto's scan
        with contextlib.ExitStack() as patches:
            ec2_tags.own_tags(patches)
            own = _listings(ec2, backend, resources)
        scanned = _listings(ec2, backend, resources)
    # Then every answer is the same
    assert [t for tags in own["get_tags"] for t in tags], "no tags were compared"
    assert own == scanned
