"""`spotcr cancel`, `submit --instance` and the refusals of restore and interrupt, against in-process moto (no VMs).

The command runs as the `spotcr` user, holding only infra/user_policy.py's policy (IAM enforced); the test itself
builds the world and plays the control plane with its own, trusted key.
"""

import io
import json
import os

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws
from spotcr_cli import actions
from spotcr_cli.aws import Cloud, CommandError
from spotcr_cli.main import main
from spotcr_contracts import events
from spotcr_contracts.protocol import exit_ends_job
from spotcr_functions import registry_schema
from spotcr_functions.models import JobRecord, Status
from spotcr_functions.registry import Registry

from rehearsal.iam import enforce, principals

REGION = "us-east-1"
ACCOUNT = "123456789012"
ASL = {"StartAt": "Wait", "States": {"Wait": {"Type": "Wait", "Seconds": 3600, "End": True}}}


@pytest.fixture
def world(monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("MOTO_EC2_LOAD_DEFAULT_AMIS", "false")
    with mock_aws():
        dynamodb = boto3.client("dynamodb", region_name=REGION)
        dynamodb.create_table(**registry_schema.create_table_arguments("jobs"))
        boto3.client("s3", region_name=REGION).create_bucket(Bucket="checkpoints")
        sfn = boto3.client("stepfunctions", region_name=REGION)
        machine = sfn.create_state_machine(
            name="recovery", definition=json.dumps(ASL), roleArn="arn:aws:iam::123456789012:role/r"
        )["stateMachineArn"]
        ec2 = boto3.client("ec2", region_name=REGION)
        image = ec2.register_image(Name="job-vm", Architecture="x86_64")["ImageId"]
        template = ec2.create_launch_template(
            LaunchTemplateName="job-vm", LaunchTemplateData={"ImageId": image, "InstanceType": "c5.large"}
        )["LaunchTemplate"]["LaunchTemplateId"]
        # A stack updated once: CloudFormation added version 2 and left $Default at version 1.
        ec2.create_launch_template_version(
            LaunchTemplateId=template, LaunchTemplateData={"ImageId": image, "UserData": "dmVyc2lvbiAy"}
        )
        file_system = boto3.client("efs", region_name=REGION).create_file_system(CreationToken="spotcr")
        outputs = {
            "EfsFileSystemId": file_system["FileSystemId"],
            "CheckpointBucket": "checkpoints",
            "JobTable": "jobs",
            "LaunchTemplateId": template,
            "LaunchTemplateVersion": "2",
            "RecoveryStateMachineArn": machine,
        }
        stack = {
            "Resources": {
                "Marker": {"Type": "AWS::SSM::Parameter", "Properties": {"Name": "/m", "Type": "String", "Value": "m"}}
            },
            "Outputs": {name: {"Value": value} for name, value in outputs.items()},
        }
        boto3.client("cloudformation", region_name=REGION).create_stack(
            StackName="spotcr", TemplateBody=json.dumps(stack)
        )
        enforcer = enforce.Enforcer(
            keys={enforce.CLI_USER_KEY: principals.cli_user(ACCOUNT, "spotcr", REGION, outputs)},
            trusted={os.environ["AWS_ACCESS_KEY_ID"]: "the test"},
            roles={},
            state=enforce.MotoState(ACCOUNT, REGION),
        )
        cloud = Cloud(region=REGION)
        with enforce.enforced(enforcer):
            with as_user():
                assert (cloud.stack.launch_template_id, cloud.stack.state_machine_arn) == (template, machine)
            yield cloud


def as_user():
    """The `spotcr` command's calls, signed with its user's own key."""
    return enforce.acting_as(enforce.CLI_USER_KEY)


def spotcr(argv, **kwargs):
    with as_user():
        return main(argv, **kwargs)


def submit(cloud, job_id="job-1", instance_type="c5.large", instance_id=None):
    job = actions.job_tags(
        job_id,
        command="python3 a.py",
        spec=None,
        storage=None,
        interval_s=10,
        fallback_types=None,
        workdir=None,
        tcp=None,
        restart_from_scratch=None,
    )
    with as_user():
        return actions.submit(
            cloud, job, instance_id=instance_id, instance_type=instance_type, on_demand=False, say=lambda line: None
        )


def running_job(cloud, job_id="job-1", status=Status.RUNNING):
    submitted = submit(cloud, job_id)
    record = JobRecord(
        job_id=job_id,
        status=status,
        generation=0,
        instance_id=submitted["instance_id"],
        az="us-east-1a",
        subnet_id="subnet-1",
        vpc_id="vpc-1",
        instance_type="c5.large",
        storage="s3",
        interval_s=10,
        tags={"spotcr:job": job_id},
        next_checkpoint_at=1,
    )
    Registry("jobs").register(record)
    return record


def test_submit_launches_the_templates_latest_version_not_its_default(world):
    # Given a stack whose launch template has a version 2 (its output) while $Default is still version 1
    # When a job is submitted
    submitted = submit(world)
    # Then its instance was launched from version 2 (EC2 tags each instance with the version it used)
    ec2 = world.client("ec2")
    [reservation] = ec2.describe_instances(InstanceIds=[submitted["instance_id"]])["Reservations"]
    tags = {t["Key"]: t["Value"] for t in reservation["Instances"][0]["Tags"]}
    assert tags["aws:ec2launchtemplate:version"] == "2"


def test_submit_without_an_instance_type_is_refused_before_anything_launches(world, capsys):
    # The template names no type, and EC2's default (m1.small, Xen) is not one the agent can run on.
    argv = ["submit", "job-1", "--command", "python3 a.py"]
    assert spotcr(argv, out=io.StringIO()) == 2
    assert "--instance-type is required" in capsys.readouterr().err
    assert world.client("ec2").describe_instances()["Reservations"] == []


def test_a_long_job_name_gets_a_client_token_ec2_accepts(world):
    tokens = []
    ec2 = world.client("ec2")
    ec2.meta.events.register("provide-client-params.ec2.RunInstances", lambda params, **_: tokens.append(params))
    submit(world, "j" * 63)
    [params] = tokens
    assert 0 < len(params["ClientToken"]) <= 64  # EC2's limit for ClientToken


def test_a_cancelled_job_is_never_ordered_a_dump_again_and_its_vms_are_released(world):
    # Given a running job whose periodic checkpoint is due, with a recovery of it in flight
    record = running_job(world)
    registry = Registry("jobs")
    assert [r.job_id for r in registry.due_jobs(now=10)] == ["job-1"]
    sfn = world.client("stepfunctions")
    sfn.start_execution(stateMachineArn=world.stack.state_machine_arn, name="job-1-g1-abcdef12", input="{}")
    s3 = world.client("s3")
    s3.put_object(Bucket="checkpoints", Key="jobs/job-1/checkpoints/1700000000000-g0-periodic.json", Body=b"{}")
    s3.put_object(Bucket="checkpoints", Key="jobs/job-1/result/manifest.json", Body=b"{}")
    s3.put_object(Bucket="checkpoints", Key="jobs/job-1/runs/r-00000000000000e1/chunks/ab/abcd", Body=b"x")
    s3.put_object(Bucket="checkpoints", Key="jobs/job-1/runs/r-00000000000000e1/result/manifest.json", Body=b"{}")
    # When it is cancelled with its checkpoints
    out = io.StringIO()
    assert spotcr(["cancel", "job-1", "--delete-checkpoints", "--json"], out=out) == 0
    result = json.loads(out.getvalue())
    # Then it is CANCELLED, the scheduler finds nothing due, its recovery is stopped and its VM terminated
    assert result["state"] == "CANCELLED" and result["was"] == "RUNNING"
    assert registry.due_jobs(now=10**12) == []
    assert result["workflows_stopped"] == ["job-1-g1-abcdef12"]
    assert result["instances_terminated"] == [record.instance_id]
    state = world.client("ec2").describe_instances(InstanceIds=[record.instance_id])["Reservations"][0]
    assert state["Instances"][0]["State"]["Name"] in ("shutting-down", "terminated")
    # And its checkpoints are gone, its stored result kept
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="checkpoints")["Contents"]]
    assert keys == ["jobs/job-1/result/manifest.json", "jobs/job-1/runs/r-00000000000000e1/result/manifest.json"]
    # And a late exit report from its VM does not end it a second time
    cancelled = registry.get("job-1")
    assert cancelled is not None
    assert cancelled.status == Status.CANCELLED and cancelled.next_checkpoint_at is None
    exited = events.JobExited(job_id="job-1", instance_id=record.instance_id, generation=0, at="", exit_code=0)
    assert exit_ends_job(cancelled, exited) is None
    # And the job's name can be submitted again
    assert registry.register(record) == record


def test_cancel_restore_and_interrupt_refuse_what_they_cannot_do_naming_the_state(world, capsys):
    running_job(world, "done-1", status=Status.COMPLETED)
    out = io.StringIO()
    assert spotcr(["cancel", "done-1"], out=out) == 0 and "COMPLETED already" in out.getvalue()
    assert spotcr(["restore", "done-1", "--checkpoint", "1700000000000-g0-periodic"]) == 1
    assert "done-1 is COMPLETED" in capsys.readouterr().err
    assert spotcr(["interrupt", "done-1"]) == 1
    assert "only a running job's instance can be interrupted" in capsys.readouterr().err
    running_job(world, "run-1")
    assert spotcr(["restore", "run-1", "--checkpoint", "1700000000000-g0-periodic"]) == 1
    assert "is not committed for job run-1" in capsys.readouterr().err
    assert spotcr(["restore", "run-1", "--checkpoint", "newest"]) == 2
    assert spotcr(["status", "nope"]) == 1 and "no job 'nope'" in capsys.readouterr().err
    with as_user(), pytest.raises(CommandError, match="no FIS experiment template"):
        actions.interrupt(world, "run-1", rebalance_first=False, say=lambda line: None)


def test_cancelling_an_efs_job_deletes_its_access_point(world):
    # Given a running efs job with its access point (made and tagged with its job at its registration)
    efs = world.client("efs")
    [file_system] = [f["FileSystemId"] for f in efs.describe_file_systems()["FileSystems"]]  # the stack's
    point = efs.create_access_point(
        FileSystemId=file_system, RootDirectory={"Path": "/jobs/job-1"}, Tags=[{"Key": "spotcr:job", "Value": "job-1"}]
    )
    running_job(world)
    Registry("jobs").update("job-1", {"access_point_arn": point["AccessPointArn"]})
    # When it is cancelled
    assert spotcr(["cancel", "job-1", "--json"], out=io.StringIO()) == 0
    # Then its access point is gone (its files on the file system stay)
    assert efs.describe_access_points(FileSystemId=file_system)["AccessPoints"] == []
    cancelled = Registry("jobs").get("job-1")
    assert cancelled is not None and cancelled.status == Status.CANCELLED


def test_the_spotcr_user_may_not_do_what_only_spotcr_does(world):
    # Given a job the user submitted, and an instance that is no job's
    record = running_job(world)
    ec2 = world.client("ec2")
    stranger = ec2.run_instances(
        LaunchTemplate={"LaunchTemplateId": world.stack.launch_template_id}, MinCount=1, MaxCount=1
    )["Instances"][0]["InstanceId"]
    with as_user():
        # When the user mints a run for the job's instance, or terminates an instance of no job
        with pytest.raises(ClientError) as forged:
            ec2.create_tags(Resources=[record.instance_id], Tags=[{"Key": "spotcr:run", "Value": "r-0000000000000001"}])
        with pytest.raises(ClientError) as terminated:
            ec2.terminate_instances(InstanceIds=[stranger])
    # Then EC2 refuses both as AWS does, naming the user
    for refused in (forged, terminated):
        error = refused.value.response["Error"]
        assert error["Code"] == "UnauthorizedOperation"
        assert f"User: arn:aws:iam::{ACCOUNT}:user/spotcr-user is not authorized" in error["Message"]


def test_submit_instance_tags_a_running_instance_from_the_stacks_template_only(world):
    # Given a running instance launched from the stack's template, and one launched without it
    ec2 = boto3.client("ec2", region_name=REGION)
    ours = ec2.run_instances(
        LaunchTemplate={"LaunchTemplateId": world.stack.launch_template_id}, MinCount=1, MaxCount=1
    )["Instances"][0]["InstanceId"]
    image = ec2.describe_images(Owners=["self"])["Images"][0]["ImageId"]
    foreign = ec2.run_instances(ImageId=image, MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    # When the user submits a job on each
    submitted = submit(world, "job-1", instance_id=ours)
    with pytest.raises(CommandError, match=f"instance {foreign} was not launched from the stack's launch template"):
        submit(world, "job-2", instance_id=foreign)
    # Then only the stack's instance carries a job: spotcr could neither command nor terminate the other
    tags_of = {
        i["InstanceId"]: i.get("Tags", []) for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]
    }
    assert submitted["instance_id"] == ours and {"Key": "spotcr:job", "Value": "job-1"} in tags_of[ours]
    assert not any(t["Key"] == "spotcr:job" for t in tags_of[foreign])


def test_submit_nodes_launches_every_node_of_a_job_over_several_vms_in_one_subnet(world, capsys):
    # When a job over three VMs is submitted (as its user, under the users' policy)
    argv = ["submit", "mpi-7", "--command", "mpiexec -n 6 ./solver", "--storage", "efs", "--nodes", "3"]
    out = io.StringIO()
    assert spotcr([*argv, "--instance-type", "c5.large", "--json"], out=out) == 0

    # Then three instances run from the template, each with the job's tags and its own index, in one subnet
    launched = json.loads(out.getvalue())["nodes"]
    ec2 = world.client("ec2")
    reservations = ec2.describe_instances(InstanceIds=[n["instance_id"] for n in launched])["Reservations"]
    instances = sorted((i for r in reservations for i in r["Instances"]), key=lambda i: i["InstanceId"])
    found = {i["InstanceId"]: ({t["Key"]: t["Value"] for t in i["Tags"]}, i["SubnetId"]) for i in instances}
    for index, node in enumerate(launched):
        tags = found[node["instance_id"]][0]
        assert (tags["spotcr:job"], tags["spotcr:nodes"], tags["spotcr:node"]) == ("mpi-7", "3", str(index))
        assert tags["spotcr:command"] == "mpiexec -n 6 ./solver" and tags["spotcr:storage"] == "efs"
    assert len({subnet for _, subnet in found.values()}) == 1
    assert "each warned or lost node moves to a backup there with its address" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--nodes", "17", "--storage", "efs"], "spotcr:nodes: must be between 1 and 16, got 17"),
        (["--nodes", "2", "--storage", "efs", "--instance", "i-0123456789abcdef0"], "--nodes launches every node"),
    ],
)
def test_submit_nodes_refuses_what_makes_no_job_over_several_vms(world, capsys, extra, message):
    argv = ["submit", "mpi-7", "--command", "mpiexec ./solver", *extra]
    assert spotcr(argv if "--instance" in extra else [*argv, "--instance-type", "c5.large"], out=io.StringIO()) == 2
    assert message in capsys.readouterr().err
    assert world.client("ec2").describe_instances()["Reservations"] == []
