"""Context options: defaults that deploy, values from `-c key=value` strings, and errors that name the option."""

from __future__ import annotations

import pytest

from infra.settings import InvalidSetting, Settings


def test_defaults_create_a_vpc_and_no_file_systems() -> None:
    settings = Settings.from_mapping({})
    assert settings.vpc_id is None and not settings.efs and settings.fsx is None
    assert settings.vm_architecture == "amd64" and settings.checkpoint_expiry_days == 0


def test_command_line_strings_are_parsed() -> None:
    settings = Settings.from_mapping(
        {
            "vpc_id": "vpc-0123456789abcdef0",
            "subnet_ids": "subnet-0aaaaaaaaaaaaaaa1, subnet-0bbbbbbbbbbbbbbb2",
            "availability_zones": '["us-east-1a", "us-east-1b"]',
            "efs": "true",
            "fsx": "SCRATCH_2",
            "ami_id": "ami-0123456789abcdef0",
            "root_volume_gib": "40",
            "keep_finished_volumes": "true",
            "interruption_concurrency": "0",
        }
    )
    assert settings.keep_finished_volumes is True and settings.interruption_concurrency == 0
    assert settings.subnet_ids == ("subnet-0aaaaaaaaaaaaaaa1", "subnet-0bbbbbbbbbbbbbbb2")
    assert settings.availability_zones == ("us-east-1a", "us-east-1b")
    assert settings.efs is True and settings.fsx == "SCRATCH_2" and settings.root_volume_gib == 40


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"vpc_id": "vpc-0123456789abcdef0"}, "subnet_ids"),
        ({"vpc_id": "vpc-0123456789abcdef0", "subnet_ids": "subnet-0aaaaaaaaaaaaaaa1"}, "availability_zones"),
        ({"subnet_ids": "subnet-0aaaaaaaaaaaaaaa1"}, "subnet_ids"),
        ({"vpc_id": "my-vpc"}, "vpc_id"),
        ({"efs": "yes"}, "efs"),
        ({"fsx": "SCRATCH_1", "ami_id": "ami-0123456789abcdef0"}, "fsx"),
        ({"fsx_storage_gib": "2000"}, "fsx_storage_gib"),
        ({"fsx": "SCRATCH_2"}, "fsx"),
        ({"vm_architecture": "x86"}, "vm_architecture"),
        ({"log_retention_days": "31"}, "log_retention_days"),
        ({"metadata_hop_limit": "3"}, "metadata_hop_limit"),
        ({"alarm_email": "nobody"}, "alarm_email"),
        ({"ami_id": "debian"}, "ami_id"),
        ({"vpcid": "vpc-0123456789abcdef0"}, "vpcid"),
        ({"keep_finished_volumes": "maybe"}, "keep_finished_volumes"),
        ({"interruption_concurrency": "-1"}, "interruption_concurrency"),
        ({"private_subnets": "maybe"}, "private_subnets"),
        ({"private_subnets": "true", "route_table_ids": "rtb-0aaaaaaaaaaaaaaa1"}, "route_table_ids"),
        (
            {
                "vpc_id": "vpc-0123456789abcdef0",
                "subnet_ids": "subnet-0aaaaaaaaaaaaaaa1",
                "availability_zones": "us-east-1a",
                "private_subnets": "true",
            },
            "route_table_ids",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_option(values: dict, named: str) -> None:
    with pytest.raises(InvalidSetting, match=named):
        Settings.from_mapping(values)


def test_no_concurrency_is_reserved_by_default() -> None:
    # Lambda keeps 100 unreserved: a reservation fails the deploy on accounts whose quota is 10 or 50.
    assert Settings.from_mapping({}).interruption_concurrency == 0


def test_fsx_with_the_default_debian_image_is_refused_naming_the_lustre_client_and_ami_id() -> None:
    # Given FSx with no image of the user's (the default Debian 12 image has no Lustre client)
    with pytest.raises(InvalidSetting, match=r"fsx: .*no Lustre client.*ami_id"):
        Settings.from_mapping({"fsx": "PERSISTENT_2"})
    # Then an image that has one is accepted
    assert Settings.from_mapping({"fsx": "PERSISTENT_2", "ami_id": "ami-0123456789abcdef0"}).fsx == "PERSISTENT_2"
