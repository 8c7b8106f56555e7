"""The GPU image option: AWS's Deep Learning Base GPU AMI through its public parameter, for x86-64 only."""

from __future__ import annotations

import json

import pytest

from infra.settings import GPU_IMAGE_PARAMETER, InvalidSetting, Settings
from tests.infra.conftest import _synth


@pytest.mark.parametrize(
    ("values", "refusal"),
    [
        ({"gpu_image": "true", "ami_id": "ami-0123456789abcdef0"}, "gpu_image: not with ami_id"),
        ({"gpu_image": "true", "vm_architecture": "arm64"}, "gpu_image: CRIU's CUDA plugin is x86-64 only"),
        ({"gpu_image": "yes"}, "gpu_image: expected true or false"),
    ],
)
def test_the_gpu_image_refuses_what_cannot_work(values: dict[str, str], refusal: str) -> None:
    with pytest.raises(InvalidSetting, match=refusal):
        Settings.from_mapping(values)


def test_the_gpu_image_gets_room_for_itself_and_a_dump() -> None:
    assert Settings.from_mapping({"gpu_image": "true"}).job_root_volume_gib == 100
    assert Settings.from_mapping({"gpu_image": "true", "root_volume_gib": "500"}).job_root_volume_gib == 500
    assert Settings.from_mapping({}).job_root_volume_gib == 20


def test_the_launch_template_boots_the_deep_learning_gpu_image(tmp_path) -> None:
    # When the stack is synthesized with gpu_image (cdk-nag runs in the synth)
    synth = _synth({"stack_name": "spotcr-gpu", "gpu_image": "true"}, tmp_path / "cdk-gpu")

    # Then the job template's image is the public parameter's, resolved at deploy time, on Ubuntu's root device
    [template] = synth.of_type("AWS::EC2::LaunchTemplate").values()
    data = template["Properties"]["LaunchTemplateData"]
    parameter = synth.template.to_json()["Parameters"][data["ImageId"]["Ref"]]
    assert parameter["Default"] == GPU_IMAGE_PARAMETER
    assert parameter["Type"] == "AWS::SSM::Parameter::Value<AWS::EC2::Image::Id>"
    [root] = data["BlockDeviceMappings"]
    assert root["DeviceName"] == "/dev/sda1"
    assert root["Ebs"]["VolumeSize"] == 100 and root["Ebs"]["Encrypted"] is True
    assert "debian" not in json.dumps(synth.template.to_json()["Parameters"])
