"""How a backup launches: the launch template's latest version, the job's own image, one instant spot fleet over
every spot candidate, and an EBS job's candidates in its volume's AZ first."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from spotcr_contracts import tags as tag_names
from spotcr_functions.cloud import Cloud
from spotcr_functions.config import ENV
from spotcr_functions.handlers import _edge

from rehearsal.controlplane import ControlPlane, ec2_event, route
from tests.workflow.support import NO_CAPACITY

NEW_USER_DATA = b"#!/bin/sh\n# the agent asset of the upgraded stack\n"


def _backup(plane: ControlPlane, job_id: str) -> dict[str, Any]:
    """The job's backup instance, once the workflow launched it."""
    record = plane.wait_until(lambda: (r := plane.job(job_id)).backup_instance_id and r, "the backup launch")
    reservations = plane.ec2.describe_instances(InstanceIds=[str(record.backup_instance_id)])["Reservations"]
    return dict(reservations[0]["Instances"][0])


def _upgrade(plane: ControlPlane, monkeypatch: pytest.MonkeyPatch, *, default: bool = False, **data: Any) -> str:
    """A stack update: CloudFormation adds a launch template version, whose number the functions get, and leaves
    $Default at version 1 (default=True: as if someone moved it)."""
    base = {"ImageId": plane.image_id, "InstanceType": "m5.large"}
    created = plane.ec2.create_launch_template_version(
        LaunchTemplateId=plane.launch_template_id, LaunchTemplateData={**base, **data}
    )
    version = str(created["LaunchTemplateVersion"]["VersionNumber"])
    if default:
        plane.ec2.modify_launch_template(LaunchTemplateId=plane.launch_template_id, DefaultVersion=version)
    monkeypatch.setenv(ENV["launch_template_version"], version)
    _edge._deps.cache_clear()
    return version


def _user_data(plane: ControlPlane, instance_id: str) -> bytes:
    attribute = plane.ec2.describe_instance_attribute(InstanceId=instance_id, Attribute="userData")
    return base64.b64decode(attribute["UserData"].get("Value", ""))


@pytest.mark.parametrize("market", ["spot", "on-demand"])
def test_a_backup_boots_the_templates_latest_version_not_its_default(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch, market: str
) -> None:
    # Given a job started before an upgrade whose new template version boots a new agent asset
    primary = plane.start_job("up-1")
    version = _upgrade(plane, monkeypatch, UserData=base64.b64encode(NEW_USER_DATA).decode())
    if market == "on-demand":
        plane.refuse_launches(lambda _t, _s, m: NO_CAPACITY if m == "spot" else None)

    # When the job is interrupted
    route(ec2_event("spot-interruption-warning", primary))
    backup = _backup(plane, "up-1")

    # Then its backup boots the new version's user data, not version 1's ($Default)
    assert version == "2"
    assert backup.get("InstanceLifecycle", "on-demand") == market
    assert _user_data(plane, backup["InstanceId"]) == NEW_USER_DATA


def test_spot_candidates_are_one_instant_fleet_over_every_type_and_subnet(plane: ControlPlane) -> None:
    # Given a job with a fallback type, in a stack with two subnets
    primary = plane.start_job("fl-1", **{tag_names.FALLBACK_TYPES: "m6i.large"})

    # When it is interrupted
    route(ec2_event("spot-interruption-warning", primary))
    backup = _backup(plane, "fl-1")

    # Then one instant fleet, price-capacity-optimized, got every (type, subnet) as an override, the job's own
    # subnet first, and the template's version by number; its instance is spot and was tagged at launch
    [fleet] = plane.ec2.describe_fleets()["Fleets"]
    assert fleet["Type"] == "instant"
    assert fleet["SpotOptions"]["AllocationStrategy"] == "price-capacity-optimized"
    assert fleet["TargetCapacitySpecification"]["DefaultTargetCapacityType"] == "spot"
    [config] = fleet["LaunchTemplateConfigs"]
    assert config["LaunchTemplateSpecification"]["Version"] == "1"
    subnets = (plane.subnets["us-east-1a"], plane.subnets["us-east-1b"])
    overrides = [(o["InstanceType"], o["SubnetId"]) for o in config["Overrides"]]
    assert overrides == [(t, s) for t in ("m5.large", "m6i.large") for s in subnets]
    assert backup["InstanceLifecycle"] == "spot"
    assert {t["Key"]: t["Value"] for t in backup["Tags"]}[tag_names.MODE] == "restore"


def test_an_ebs_job_tries_every_type_in_its_volumes_az_before_another_az(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an EBS job in AZ a with a fallback type, and no spot capacity for its own type in AZ a
    primary = plane.start_job("az-1", **{tag_names.STORAGE: "ebs", tag_names.FALLBACK_TYPES: "m6i.large"})
    zone_a = plane.subnets["us-east-1a"]
    tried = plane.refuse_launches(lambda t, s, _m: NO_CAPACITY if (t, s) == ("m5.large", zone_a) else None)

    # When it is interrupted
    route(ec2_event("spot-interruption-warning", primary))
    backup = _backup(plane, "az-1")

    # Then the fallback type in the volume's AZ was taken before the job's type in AZ b (a snapshot move)
    assert tried == [("m5.large", zone_a, "spot"), ("m6i.large", zone_a, "spot")]
    assert (backup["InstanceType"], backup["Placement"]["AvailabilityZone"]) == ("m6i.large", "us-east-1a")


def test_a_backup_launches_from_its_jobs_image_after_a_redeploy_changed_the_templates(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a job registered on the template's image, then a redeploy that resolved a newer image
    primary = plane.start_job("ami-1")
    assert plane.job("ami-1").image_id == plane.image_id
    newer = plane.ec2.register_image(Name="debian-12-newer", Architecture="x86_64")["ImageId"]
    _upgrade(plane, monkeypatch, default=True, ImageId=newer)

    # When the job is interrupted
    route(ec2_event("spot-interruption-warning", primary))
    backup = _backup(plane, "ami-1")

    # Then the backup runs the image the job's checkpoints were taken on
    assert backup["ImageId"] == plane.image_id
    assert plane.job("ami-1").image_warning is None


def test_a_backup_whose_jobs_image_is_gone_launches_from_the_templates_and_says_so(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a job whose image was deregistered after a redeploy resolved a newer one
    primary = plane.start_job("ami-2")
    newer = plane.ec2.register_image(Name="debian-12-newer", Architecture="x86_64")["ImageId"]
    _upgrade(plane, monkeypatch, ImageId=newer)
    plane.ec2.deregister_image(ImageId=plane.image_id)

    # When the job is interrupted
    route(ec2_event("spot-interruption-warning", primary))
    backup = _backup(plane, "ami-2")

    # Then the backup launches from the template's image, and the record says why
    assert backup["ImageId"] == newer
    assert f"image {plane.image_id} of the job's instance is gone" in str(plane.job("ami-2").image_warning)


def test_the_jobs_image_is_looked_up_once_per_recovery_not_once_per_candidate(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a job whose spot candidates all find no capacity, so that its on-demand candidate launches
    primary = plane.start_job("ami-3")
    plane.refuse_launches(lambda _t, _s, m: NO_CAPACITY if m == "spot" else None)
    looked_up: list[str] = []
    image_exists = Cloud.image_exists

    def counted(self: Cloud, image_id: str) -> bool:
        looked_up.append(image_id)
        return image_exists(self, image_id)

    monkeypatch.setattr(Cloud, "image_exists", counted)

    # When the job is interrupted
    route(ec2_event("spot-interruption-warning", primary))
    backup = _backup(plane, "ami-3")

    # Then its second candidate launched from the job's image, which was looked up once (one DescribeImages)
    assert backup.get("InstanceLifecycle", "on-demand") == "on-demand"
    assert backup["ImageId"] == plane.image_id
    assert looked_up == [plane.image_id]
