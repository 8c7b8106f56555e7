"""The local cloud on its own: VMs boot in their own namespaces, SSM runs documents there, events route."""

import base64
import json
import os
import re
import sys
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError
from spotcr_functions.config import ENV

from rehearsal import ssm_agent
from rehearsal.cloud import PREFIX, REGION, LocalCloud
from rehearsal.timeline import Timeline
from rehearsal.vm import REPO
from tests.support import wait_for

EVENTS = Path(__file__).parents[1] / "events" / "ssm"


def launch(cloud, tags):
    reservation = cloud.client("ec2").run_instances(
        ImageId=cloud.image_id,
        MinCount=1,
        MaxCount=1,
        InstanceType="c5.large",
        TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}],
    )
    instance_id = reservation["Instances"][0]["InstanceId"]
    vm = wait_for(lambda: cloud.vms.get(instance_id))
    wait_for(lambda: vm.running_at is not None)
    return instance_id, vm


@pytest.mark.criu
def test_each_vm_has_its_own_private_paths_and_pid_namespace(cloud):
    # Given two running VMs
    _first_id, first = launch(cloud, {"Name": "a"})
    _second_id, second = launch(cloud, {"Name": "b"})
    # When each writes the same path
    first.run(["sh", "-c", "echo first > /var/lib/spotcr/who"])
    second.run(["sh", "-c", "echo second > /var/lib/spotcr/who"])
    # Then each reads its own, and sees only its own processes
    assert first.run(["cat", "/var/lib/spotcr/who"]).stdout == "first\n"
    assert second.run(["cat", "/var/lib/spotcr/who"]).stdout == "second\n"
    assert first.host_path("/var/lib/spotcr/who").read_text() == "first\n"
    pids = first.run(["ls", "/proc"]).stdout.split()
    assert "1" in pids and len([p for p in pids if p.isdigit()]) < 10


@pytest.mark.criu
def test_imds_serves_the_instance_tags_and_the_spot_notice(cloud):
    instance_id, vm = launch(cloud, {"spotcr:job": "demo"})
    read = vm.run(["/opt/spotcr/bin/spotcr-agent", "imds", "meta-data/tags/instance/spotcr:job"])
    assert read.stdout.strip() == "demo", read.stderr
    assert vm.run(["/opt/spotcr/bin/spotcr-agent", "imds", "meta-data/instance-id"]).stdout.strip() == instance_id
    assert vm.run(["/opt/spotcr/bin/spotcr-agent", "imds", "meta-data/spot/instance-action"]).returncode == 4


@pytest.mark.criu
def test_send_command_runs_the_document_in_the_target_vm(cloud, events):
    instance_id, _vm = launch(cloud, {"Name": "a"})
    wait_for(lambda: cloud.managed_instances.online(instance_id))
    ssm = cloud.client("ssm")
    command_id = ssm.send_command(
        InstanceIds=[instance_id],
        DocumentName=f"{PREFIX}-checkpoint",
        Parameters={"JobId": ["demo"], "Generation": ["3"], "Kind": ["final"]},
    )["Command"]["CommandId"]

    def finished():
        invocation = ssm.get_command_invocation(CommandId=command_id, InstanceId=instance_id)
        return invocation if invocation["Status"] != "InProgress" else None

    invocation = wait_for(finished)
    assert invocation["Status"] == "Success"
    assert json.loads(invocation["StandardOutputContent"]) == {
        "argv": ["checkpoint", "--job", "demo", "--generation", "3", "--kind", "final"],
        "instance": instance_id,
    }
    # and SSM's status-change event for the invocation says where to look, as AWS's sample does
    sample = json.loads((EVENTS / "command-invocation-status-change.json").read_text())
    [ended] = wait_for(lambda: [e for e in events if e["Source"] == sample["source"]])
    assert ended["DetailType"] == sample["detail-type"]
    detail = json.loads(ended["Detail"])
    assert detail.keys() == sample["detail"].keys()
    assert (detail["command-id"], detail["instance-id"], detail["status"]) == (command_id, instance_id, "Success")


def test_send_command_refuses_parameters_that_fail_the_document_pattern(cloud):
    with pytest.raises(Exception, match="InvalidParameters"):
        cloud.client("ssm").send_command(
            InstanceIds=["i-0123456789abcdef0"],
            DocumentName=f"{PREFIX}-checkpoint",
            Parameters={"JobId": ["demo; rm -rf /"], "Generation": ["3"], "Kind": ["final"]},
        )


@pytest.mark.criu
def test_running_and_terminated_state_changes_are_emitted(cloud, events):
    instance_id, vm = launch(cloud, {"Name": "a"})
    cloud.client("ec2").terminate_instances(InstanceIds=[instance_id])
    wait_for(lambda: vm.terminated)

    def states():
        return [
            json.loads(e["Detail"])["state"]
            for e in events
            if e.get("DetailType") == "EC2 Instance State-change Notification"
            and json.loads(e["Detail"])["instance-id"] == instance_id
        ]

    wait_for(lambda: "terminated" in states())
    assert states() == ["pending", "running", "shutting-down", "terminated"]
    assert vm.run.__self__.terminated


@pytest.mark.criu
def test_an_instance_terminated_twice_is_reported_terminated_once(cloud, events):
    # Given an interrupted instance that the control plane terminates, and then the interruption itself
    instance_id, _ = launch(cloud, {"Name": "a"})
    cloud.client("ec2").terminate_instances(InstanceIds=[instance_id])
    wait_for(lambda: cloud.timeline.find("terminated", instance_id))
    cloud.client("ec2").terminate_instances(InstanceIds=[instance_id])
    # A report comes from a thread of its own, started by the call: wait until every such thread is done
    wait_for(lambda: not [t for t in cloud._threads if t.name == f"terminated-{instance_id}" and t.is_alive()])

    # Then its end is shown once and its state changes are emitted once each
    assert len(cloud.timeline.find("terminated", instance_id)) == 1
    states = [
        json.loads(e["Detail"])["state"]
        for e in events
        if e.get("DetailType") == "EC2 Instance State-change Notification"
        and json.loads(e["Detail"])["instance-id"] == instance_id
    ]
    assert states == ["pending", "running", "shutting-down", "terminated"]


@pytest.mark.criu
def test_an_ebs_volume_moves_between_vms_with_its_data(cloud):
    # Given a new volume attached to a first VM, which formats it and writes a file
    ec2 = cloud.client("ec2")
    first_id, first = launch(cloud, {"Name": "a"})
    second_id, second = launch(cloud, {"Name": "b"})
    volume_id = ec2.create_volume(AvailabilityZone="us-east-1a", Size=1)["VolumeId"]
    ec2.attach_volume(VolumeId=volume_id, InstanceId=first_id, Device="/dev/sdf")
    link = f"/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_vol{volume_id.removeprefix('vol-')}"
    script = f"mkfs.ext4 -q {link} && mkdir -p /mnt/spotcr && mount {link} /mnt/spotcr && echo kept > /mnt/spotcr/f"
    assert first.run(["sh", "-c", script + " && umount /mnt/spotcr"]).returncode == 0
    assert second.run(["test", "-e", link]).returncode == 1
    # When it is detached and attached to the second VM
    ec2.detach_volume(VolumeId=volume_id)
    ec2.attach_volume(VolumeId=volume_id, InstanceId=second_id, Device="/dev/sdf")
    # Then only the second VM has it, with the data
    assert first.run(["test", "-e", link]).returncode == 1
    read = second.run(["sh", "-c", f"mount {link} /mnt/spotcr && cat /mnt/spotcr/f && umount /mnt/spotcr"])
    assert read.stdout == "kept\n", read.stderr


@pytest.mark.criu
def test_each_job_vm_signs_as_its_own_instance_profile_session(cloud):
    # Given two job VMs, each registering with SSM from inside (the agent stand-in at boot)
    first, first_vm = launch(cloud, {"Name": "first"})
    second, second_vm = launch(cloud, {"Name": "second"})
    role = cloud.names["job_role"]
    sessions = {i: f"arn:aws:sts::{cloud.enforcer.state.account}:assumed-role/{role}/{i}" for i in (first, second)}

    # Then each registered as the job role's session named by its own instance id, with a key of its own
    registered = [(session, "ssm:UpdateInstanceInformation") for session in sessions.values()]
    wait_for(lambda: all(call in cloud.enforcer.evaluated for call in registered), "each VM's registration")
    assert first_vm.env["AWS_ACCESS_KEY_ID"] != second_vm.env["AWS_ACCESS_KEY_ID"]

    # And a call it is not granted is refused naming its session, with the instance AWS puts in its context
    import boto3

    dynamodb = boto3.client(
        "dynamodb",
        endpoint_url=cloud.endpoint,
        region_name="us-east-1",
        aws_access_key_id=first_vm.env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key="x",
    )
    with pytest.raises(ClientError) as refused:
        dynamodb.get_item(TableName=cloud.names["jobs_table"], Key={"job_id": {"S": "j"}})
    assert sessions[first] in refused.value.response["Error"]["Message"]
    [denial] = [d for d in cloud.enforcer.denials if d.principal == sessions[first]]
    assert {r.context["ec2:SourceInstanceARN"] for r in denial.requests} == {
        f"arn:aws:ec2:us-east-1:{cloud.enforcer.state.account}:instance/{first}"
    }


@pytest.mark.criu
def test_send_command_is_refused_until_the_vms_ssm_agent_registers(cloud):
    # Given a running VM whose boot did not start the SSM agent stand-in
    cloud.boot_commands = [["sleep", "infinity"]]
    instance_id, vm = launch(cloud, {"Name": "no-agent"})
    ssm = cloud.client("ssm")
    checkpoint = {"JobId": ["demo"], "Generation": ["3"], "Kind": ["final"]}
    # When a command is sent to it, Then SSM refuses it as AWS does
    with pytest.raises(ClientError) as refused:
        ssm.send_command(InstanceIds=[instance_id], DocumentName=f"{PREFIX}-checkpoint", Parameters=checkpoint)
    # As AWS answers (tests/events/ssm/send-command-invalid-instance-id.json): same code, same message shape
    published = json.loads((EVENTS / "send-command-invalid-instance-id.json").read_text())["Error"]
    error = refused.value.response["Error"]
    assert error["Code"] == published["Code"]
    shape = re.escape(published["Message"]).replace("i\\-00903e1796f3b1cb6", "(i-[0-9a-f]+)")
    assert re.fullmatch(shape.replace("775288309636", "[0-9]{12}"), error["Message"])
    assert f"[[{instance_id}]]" in error["Message"]
    assert (
        ssm.describe_instance_information(Filters=[{"Key": "InstanceIds", "Values": [instance_id]}])[
            "InstanceInformationList"
        ]
        == []
    )
    # When the stand-in registers the VM (what amazon-ssm-agent does once started)
    registered = vm.run(["env", f"PYTHONPATH={REPO}", sys.executable, "-m", ssm_agent.__name__])
    assert registered.returncode == 0, registered.stdout + registered.stderr
    # Then the instance is Online and the command goes through
    listed = ssm.describe_instance_information(Filters=[{"Key": "PingStatus", "Values": ["Online"]}])
    assert [row["InstanceId"] for row in listed["InstanceInformationList"]] == [instance_id]
    ssm.send_command(InstanceIds=[instance_id], DocumentName=f"{PREFIX}-checkpoint", Parameters=checkpoint)


@pytest.mark.criu
def test_a_terminated_instance_loses_its_ssm_connection(cloud):
    instance_id, vm = launch(cloud, {"Name": "a"})
    wait_for(lambda: cloud.managed_instances.online(instance_id))
    cloud.client("ec2").terminate_instances(InstanceIds=[instance_id])
    wait_for(lambda: vm.terminated)
    info = cloud.client("ssm").describe_instance_information(Filters=[{"Key": "InstanceIds", "Values": [instance_id]}])
    assert info["InstanceInformationList"][0]["PingStatus"] == "ConnectionLost"
    with pytest.raises(ClientError, match="InvalidInstanceId"):
        cloud.client("ssm").send_command(
            InstanceIds=[instance_id],
            DocumentName=f"{PREFIX}-status",
            Parameters={"JobId": ["demo"]},
        )


def test_a_stopped_cloud_leaves_no_thread_that_acts_later(tmp_path):
    # Given a cloud with a pending termination, as an interruption's notice runs (rehearsal/scenario.py)
    local = LocalCloud(run_dir=tmp_path, timeline=Timeline(echo=None), with_workflow=False)
    local.start()
    acted: list[str] = []

    def terminate() -> None:
        if local.sleep(600):
            acted.append("terminated")

    local.spawn(terminate, name="terminate-i-0")

    # When the cloud stops before the notice ends
    local.stop()

    # Then the termination never happens, and stop waited for its thread rather than leave it to a later cloud
    assert acted == []
    assert not [t for t in local._threads if t.is_alive()]


def test_an_upgrade_is_a_new_launch_template_version_naming_a_new_asset_and_the_old_asset_is_refused(tmp_path):
    # Given a stack deployed with its agent asset
    local = LocalCloud(run_dir=tmp_path, timeline=Timeline(echo=None), with_workflow=False, with_agent_asset=True)
    local.start()
    try:
        ec2 = local.client("ec2")
        template_id = local.settings_env[ENV["launch_template_id"]]
        first = local.agent_asset_url

        # When the stack is upgraded, as `cdk deploy` of a changed agent does
        version = local.upgrade_stack("deployment 2")

        # Then a new version names the new asset, $Default stays version 1, and the functions and outputs name it
        versions = ec2.describe_launch_template_versions(LaunchTemplateId=template_id)["LaunchTemplateVersions"]
        user_data = {
            v["VersionNumber"]: base64.b64decode(v["LaunchTemplateData"]["UserData"]).decode() for v in versions
        }
        assert version == "2" and local.agent_asset_url != first
        assert f'AGENT_ASSET_URL="{first}"' in user_data[1]
        assert f'AGENT_ASSET_URL="{local.agent_asset_url}"' in user_data[2]
        assert [v["VersionNumber"] for v in versions if v["DefaultVersion"]] == [1]
        assert os.environ[ENV["launch_template_version"]] == "2"
        function = local.client("lambda").get_function_configuration(FunctionName=f"{PREFIX}-tag-change")
        assert function["Environment"]["Variables"][ENV["launch_template_version"]] == "2"
        stack = local.client("cloudformation").describe_stacks(StackName=PREFIX)["Stacks"][0]
        assert {o["OutputKey"]: o["OutputValue"] for o in stack["Outputs"]}["LaunchTemplateVersion"] == "2"
        # And the job role may read the new asset only: CDK's grant is per asset
        job_vm = local.instance_env("i-0123456789abcdef0")
        s3 = boto3.client(
            "s3",
            region_name=REGION,
            endpoint_url=local.endpoint,
            aws_access_key_id=job_vm["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=job_vm["AWS_SECRET_ACCESS_KEY"],
        )
        bucket, _, new_key = local.agent_asset_url.removeprefix("s3://").partition("/")
        assert s3.get_object(Bucket=bucket, Key=new_key)["Body"].read()
        with pytest.raises(ClientError) as refused:
            s3.get_object(Bucket=bucket, Key=first.rpartition("/")[2])
        assert refused.value.response["Error"]["Code"] == "AccessDenied"
        assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    finally:
        local.stop()


def test_an_upgrade_names_its_launch_template_version_in_the_stack_outputs_and_the_clouds_copy(cloud):
    # When the stack is upgraded (a new launch template version)
    version = cloud.upgrade_stack("deployment 2")

    # Then the stack's outputs, as `spotcr` reads them, name that version, and the cloud's own copy is not stale
    stack = cloud.client("cloudformation").describe_stacks(StackName=PREFIX)["Stacks"][0]
    outputs = {output["OutputKey"]: output["OutputValue"] for output in stack["Outputs"]}
    assert outputs["LaunchTemplateVersion"] == version == "2"
    assert cloud.stack_outputs == outputs
