"""The `spotcr` command's IAM policy (infra/user_policy.py) grants every AWS call the command makes, and no other.

An AST scan of cli/spotcr_cli finds each boto3 call: on clients bound to a name (`ec2 = cloud.client("ec2")`,
`boto3.client("s3")`, a parameter named after its service), called directly (`cloud.client("ec2").x(...)`), through
paginators, and through the control plane's Registry (whose DynamoDB calls tests/infra/support.py finds).
"""

from __future__ import annotations

import ast
import io
import json
from collections.abc import Iterator
from contextlib import redirect_stdout
from functools import cache

import boto3
from moto import mock_aws
from spotcr_cli import actions

from infra.user_policy import cli_user_policy, main
from rehearsal.iam.policy import ContextValue, Principal, Request, evaluate
from tests.infra.conftest import REPO_ROOT
from tests.infra.support import IMPLIED, used_by

CLI = REPO_ROOT / "cli" / "spotcr_cli"
# boto3 client name -> IAM prefix
SERVICE_PREFIX = {"stepfunctions": "states", "efs": "elasticfilesystem", "service-quotas": "servicequotas"}
SERVICE_PARAMETERS = {"ec2", "s3", "ssm", "fis", "efs"}  # a parameter so named holds that service's client
ACTION_OF = {
    "s3:ListObjectsV2": "s3:ListBucket",
    "s3:DeleteObjects": "s3:DeleteObject",
    "s3:HeadBucket": "s3:ListBucket",
}
IMPLIED_HERE = {"fis:StartExperiment": {"fis:TagResource"}}  # spotcr interrupt tags the experiment as it starts
# `spotcr probe --s3 BUCKET` runs the agent's own store here (spotcr_agent.store.backends.S3Backend): its calls.
AGENT_STORE = {"s3:PutObject", "s3:GetObject", "s3:ListBucket", "s3:DeleteObject"}

REGION, ACCOUNT = "eu-west-1", "111122223333"
OUTPUTS = {
    "CheckpointBucket": "spotcr-storagecheckpointbucket-1a2b3c",
    "JobTable": "spotcr-ControlPlaneJobs-1A2B3C",
    "LaunchTemplateId": "lt-0123456789abcdef0",
    "RecoveryStateMachineArn": f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:spotcr-recovery",
    "StatusDocument": "spotcr-status",
    "ProbeDocument": "spotcr-probe",
    "InterruptExperimentTemplate": "EXT1a2b3c4d5e6f7",
    "RebalanceInterruptExperimentTemplate": "EXT7f6e5d4c3b2a1",
    "EfsFileSystemId": "fs-0123456789abcdef0",
}
INSTANCE = f"arn:aws:ec2:{REGION}:{ACCOUNT}:instance/i-0123456789abcdef0"


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def _client_service(node: ast.expr) -> str | None:
    """`cloud.client("ec2")` or `boto3.client("ec2", ...)`: the service named."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "client"):
        return None
    first = node.args[0] if node.args else None
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def _bindings(function: ast.FunctionDef) -> dict[str, str]:
    names = {a.arg: a.arg for a in function.args.args if a.arg in SERVICE_PARAMETERS}
    for node in ast.walk(function):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = (
                zip(target.elts, node.value.elts, strict=False)
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                else [(target, node.value)]
            )
            for name, value in pairs:
                if not isinstance(name, ast.Name):
                    continue
                service = _client_service(value)
                if service:
                    names[name.id] = service
                elif isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "Registry":
                    names[name.id] = "Registry"
    return names


def _action(service: str, operation: str) -> str:
    action = f"{SERVICE_PREFIX.get(service, service)}:{_camel(operation)}"
    return ACTION_OF.get(action, action)


def _calls(function: ast.FunctionDef) -> Iterator[str]:
    names = _bindings(function)
    for node in ast.walk(function):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        service = names.get(owner.id) if isinstance(owner, ast.Name) else _client_service(owner)
        if service == "Registry":
            yield from (action for _, action in used_by(f"spotcr_functions.registry.Registry.{node.func.attr}"))
        elif service and node.func.attr == "get_paginator":
            yield _action(service, str(node.args[0].value))  # type: ignore[attr-defined]
        elif service:
            yield _action(service, node.func.attr)


@cache
def cli_calls() -> frozenset[str]:
    found: set[str] = set()
    for path in sorted(CLI.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                found.update(_calls(node))
    for action in list(found):
        found |= IMPLIED.get(action, set()) | IMPLIED_HERE.get(action, set())
    return frozenset(found)


def _granted() -> set[str]:
    policy = cli_user_policy("spotcr", REGION, ACCOUNT, OUTPUTS)
    return {action for s in policy["Statement"] for action in s["Action"]}


def test_the_scan_finds_calls_made_every_way_the_command_makes_them() -> None:
    calls = cli_calls()
    assert "ec2:RunInstances" in calls  # ec2 = cloud.client("ec2"); ec2.run_instances
    assert "ec2:TerminateInstances" in calls  # cloud.client("ec2").terminate_instances
    assert "dynamodb:Scan" in calls  # a paginator
    assert "dynamodb:UpdateItem" in calls  # through the registry's transitions
    assert "ssm:SendCommand" in calls  # a parameter named ssm (spotcr probe --instance)
    assert "pricing:GetProducts" in calls  # boto3.client("pricing", ...)
    assert "iam:PassRole" in calls  # implied by RunInstances


def test_every_call_the_command_makes_is_granted() -> None:
    missing = cli_calls() - _granted()
    assert not missing, f"spotcr calls these without a grant in infra/user_policy.py: {sorted(missing)}"


def test_every_granted_action_is_one_the_command_makes() -> None:
    unused = _granted() - cli_calls() - AGENT_STORE
    assert not unused, f"infra/user_policy.py grants actions spotcr never calls: {sorted(unused)}"


def _user(**outputs: str) -> Principal:
    policy = cli_user_policy("spotcr", REGION, ACCOUNT, {**OUTPUTS, **outputs})
    return Principal(f"arn:aws:iam::{ACCOUNT}:user/ana", (policy,))


def test_the_policy_lets_a_user_submit_a_job_from_the_stacks_template_only() -> None:
    template = f"arn:aws:ec2:{REGION}:{ACCOUNT}:launch-template/{OUTPUTS['LaunchTemplateId']}"
    tagged: dict[str, ContextValue] = {
        "ec2:LaunchTemplate": template,
        "aws:RequestTag/spotcr:job": "train-1",
        "aws:TagKeys": ("spotcr:job",),
    }
    assert evaluate(_user(), Request("ec2:RunInstances", INSTANCE, tagged)).allowed
    assert evaluate(_user(), Request("ec2:RunInstances", template, tagged)).allowed
    other = {**tagged, "ec2:LaunchTemplate": template.replace("lt-0", "lt-9")}
    assert not evaluate(_user(), Request("ec2:RunInstances", INSTANCE, other)).allowed
    untagged = {"ec2:LaunchTemplate": template}
    assert not evaluate(_user(), Request("ec2:RunInstances", INSTANCE, untagged)).allowed


def test_the_policy_lets_a_user_launch_with_every_tag_spotcr_submit_writes() -> None:
    # Given a job with every option `spotcr submit` takes, a declared result included
    job = actions.job_tags(
        "train-1",
        command="python3 train.py",
        spec=None,
        storage="ebs",
        interval_s=60,
        fallback_types="m5.xlarge",
        workdir="/var/lib/spotcr/work/train-1",
        tcp="close",
        restart_from_scratch=False,
        result="model.bin",
    )
    template = f"arn:aws:ec2:{REGION}:{ACCOUNT}:launch-template/{OUTPUTS['LaunchTemplateId']}"
    launch: dict[str, ContextValue] = {
        "ec2:LaunchTemplate": template,
        "ec2:CreateAction": "RunInstances",
        "aws:TagKeys": tuple(job),
        **{f"aws:RequestTag/{key}": value for key, value in job.items()},
    }
    # Then the user may launch it with those tags and write them on a job instance
    assert evaluate(_user(), Request("ec2:RunInstances", INSTANCE, launch)).allowed
    assert evaluate(_user(), Request("ec2:CreateTags", INSTANCE, launch)).allowed


def test_the_policy_never_lets_a_user_write_the_run_id_spotcr_mints() -> None:
    job: dict[str, ContextValue] = {"aws:ResourceTag/spotcr:job": "train-1"}
    assert evaluate(_user(), Request("ec2:CreateTags", INSTANCE, {**job, "aws:TagKeys": ("spotcr:interrupt",)})).allowed
    forged: dict[str, ContextValue] = {**job, "aws:TagKeys": ("spotcr:job", "spotcr:run")}
    assert not evaluate(_user(), Request("ec2:CreateTags", INSTANCE, forged)).allowed


def test_the_policy_stops_and_commands_only_job_instances_launched_from_the_stacks_template() -> None:
    # Given a job instance from the stack's template, and one a user tagged spotcr:job but launched otherwise
    template = OUTPUTS["LaunchTemplateId"]
    ours = {"aws:ResourceTag/spotcr:job": "j", "aws:ResourceTag/aws:ec2launchtemplate:id": template}
    foreign = {"aws:ResourceTag/spotcr:job": "j", "aws:ResourceTag/aws:ec2launchtemplate:id": "lt-0ffffffffffffffff"}
    # Then the user may terminate and command only the stack's (spotcr:job alone is user-writable)
    for action, prefix in (("ec2:TerminateInstances", "aws:ResourceTag"), ("ssm:SendCommand", "ssm:resourceTag")):
        context = {key.replace("aws:ResourceTag", prefix, 1): value for key, value in ours.items()}
        assert evaluate(_user(), Request(action, INSTANCE, context)).allowed, action
        for without in (foreign, {"aws:ResourceTag/spotcr:job": "j"}, {}):
            context = {key.replace("aws:ResourceTag", prefix, 1): value for key, value in without.items()}
            assert not evaluate(_user(), Request(action, INSTANCE, context)).allowed, (action, without)


def test_the_policy_names_resources_in_the_regions_partition() -> None:
    # Given a stack in a China region (its state machine's ARN, an output, is in that partition already)
    machine = f"arn:aws-cn:states:cn-north-1:{ACCOUNT}:stateMachine:spotcr-recovery"
    policy = cli_user_policy("spotcr", "cn-north-1", ACCOUNT, {**OUTPUTS, "RecoveryStateMachineArn": machine})
    # Then every resource it names is an arn:aws-cn: ARN
    resources = [r for s in policy["Statement"] for r in s["Resource"] if r != "*"]
    assert resources and all(r.startswith("arn:aws-cn:") for r in resources), resources


def test_the_command_prints_the_policy_of_a_deployed_stack() -> None:
    with mock_aws():
        template = {
            "Resources": {"Marker": {"Type": "AWS::SNS::Topic"}},
            "Outputs": {name: {"Value": value} for name, value in OUTPUTS.items()},
        }
        boto3.client("cloudformation", region_name=REGION).create_stack(
            StackName="spotcr", TemplateBody=json.dumps(template)
        )
        out = io.StringIO()
        with redirect_stdout(out):
            assert main(["--stack", "spotcr", "--region", REGION, "--account", ACCOUNT]) == 0
    assert json.loads(out.getvalue()) == cli_user_policy("spotcr", REGION, ACCOUNT, OUTPUTS)


def test_the_policy_lets_the_user_launch_under_a_customer_managed_ebs_key_only_as_ec2_uses_it() -> None:
    key = f"arn:aws:kms:{REGION}:{ACCOUNT}:key/1234abcd-12ab-34cd-56ef-1234567890ab"
    through_ec2: dict[str, ContextValue] = {
        "kms:ViaService": f"ec2.{REGION}.amazonaws.com",
        "kms:CallerAccount": ACCOUNT,
    }
    for action in ("kms:GenerateDataKeyWithoutPlaintext", "kms:Decrypt", "kms:ReEncryptFrom", "kms:ReEncryptTo"):
        assert evaluate(_user(), Request(action, key, through_ec2)).allowed, action
        assert not evaluate(_user(), Request(action, key, {"kms:CallerAccount": ACCOUNT})).allowed, action
    elsewhere = {**through_ec2, "kms:ViaService": "ec2.us-east-1.amazonaws.com"}
    assert not evaluate(_user(), Request("kms:Decrypt", key, elsewhere)).allowed
    for_the_volume: dict[str, ContextValue] = {**through_ec2, "kms:GrantIsForAWSResource": True}
    assert evaluate(_user(), Request("kms:CreateGrant", key, for_the_volume)).allowed
    assert not evaluate(_user(), Request("kms:CreateGrant", key, through_ec2)).allowed
    # preflight reads which key it is, directly
    assert evaluate(_user(), Request("kms:DescribeKey", key, {})).allowed


def test_the_policy_scopes_preflights_reads_to_the_public_parameters_the_spot_role_and_the_vcpu_quotas() -> None:
    public = f"arn:aws:ssm:{REGION}::parameter/aws/service/global-infrastructure/regions/{REGION}/services"
    assert evaluate(_user(), Request("ssm:GetParametersByPath", public, {})).allowed
    secrets = f"arn:aws:ssm:{REGION}:{ACCOUNT}:parameter/team/db-password"
    assert not evaluate(_user(), Request("ssm:GetParametersByPath", secrets, {})).allowed
    spot_role = f"arn:aws:iam::{ACCOUNT}:role/aws-service-role/spot.amazonaws.com/AWSServiceRoleForEC2Spot"
    assert evaluate(_user(), Request("iam:GetRole", spot_role, {})).allowed
    assert not evaluate(_user(), Request("iam:GetRole", f"arn:aws:iam::{ACCOUNT}:role/admin", {})).allowed
    quota = f"arn:aws:servicequotas:{REGION}:{ACCOUNT}:ec2/L-34B43A08"
    assert evaluate(_user(), Request("servicequotas:GetServiceQuota", quota, {})).allowed
    other = f"arn:aws:servicequotas:{REGION}:{ACCOUNT}:lambda/L-B99A9384"
    assert not evaluate(_user(), Request("servicequotas:GetServiceQuota", other, {})).allowed


def test_the_policy_lets_selftest_read_only_the_stacks_fis_templates() -> None:
    fis = f"arn:aws:fis:{REGION}:{ACCOUNT}:experiment-template"
    template = OUTPUTS["InterruptExperimentTemplate"]
    assert evaluate(_user(), Request("fis:GetExperimentTemplate", f"{fis}/{template}", {})).allowed
    assert not evaluate(_user(), Request("fis:GetExperimentTemplate", f"{fis}/EXTother", {})).allowed
