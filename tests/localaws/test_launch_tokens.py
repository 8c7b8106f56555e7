"""The local EC2 launches once per ClientToken, as EC2 does: a retried launch step gets its first answer back."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto import mock_aws

from rehearsal.localaws import REGION, fleet


@pytest.fixture
def ec2() -> Iterator[tuple[Any, str, str]]:
    """An EC2 client with the rehearsal's idempotent launches on, a launch template and a subnet."""
    with mock_aws(), contextlib.ExitStack() as patches:
        fleet.idempotent_launches(patches)
        client = boto3.client("ec2", region_name=REGION)
        image = client.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
        template = client.create_launch_template(
            LaunchTemplateName="t", LaunchTemplateData={"ImageId": image, "InstanceType": "m5.large"}
        )["LaunchTemplate"]["LaunchTemplateId"]
        subnet = client.describe_subnets()["Subnets"][0]["SubnetId"]
        yield client, template, subnet


def _live(client: Any) -> list[str]:
    reservations = client.describe_instances()["Reservations"]
    return [i["InstanceId"] for r in reservations for i in r["Instances"] if i["State"]["Name"] != "terminated"]


def _fleet(client: Any, template: str, subnet: str, token: str) -> list[str]:
    response = client.create_fleet(
        Type="instant",
        ClientToken=token,
        TargetCapacitySpecification={"TotalTargetCapacity": 1, "DefaultTargetCapacityType": "spot"},
        LaunchTemplateConfigs=[
            {
                "LaunchTemplateSpecification": {"LaunchTemplateId": template, "Version": "1"},
                "Overrides": [{"InstanceType": "m5.large", "SubnetId": subnet}],
            }
        ],
    )
    return [i for launched in response["Instances"] for i in launched["InstanceIds"]]


def test_a_fleet_repeated_with_its_client_token_launches_nothing_more(ec2: tuple[Any, str, str]) -> None:
    client, template, subnet = ec2
    first = _fleet(client, template, subnet, "backup-1")
    assert _fleet(client, template, subnet, "backup-1") == first
    assert _live(client) == first
    # Another token is another launch
    assert _fleet(client, template, subnet, "backup-2") != first
    assert len(_live(client)) == 2


def test_run_instances_repeated_with_its_client_token_launches_nothing_more(ec2: tuple[Any, str, str]) -> None:
    client, template, subnet = ec2

    def run(token: str) -> list[str]:
        response = client.run_instances(
            LaunchTemplate={"LaunchTemplateId": template}, SubnetId=subnet, MinCount=1, MaxCount=1, ClientToken=token
        )
        return [i["InstanceId"] for i in response["Instances"]]

    first = run("on-demand-1")
    assert run("on-demand-1") == first
    assert _live(client) == first
