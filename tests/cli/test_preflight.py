"""`spotcr preflight` against in-process moto and the local account's settings: all pass, then each check broken.

The command runs as the `spotcr` user, holding only infra/user_policy.py's policy (IAM enforced); the test builds
and breaks the account with its own, trusted key.
"""

import io
import os

import boto3
import pytest
from moto import mock_aws
from spotcr_cli import preflight
from spotcr_cli.aws import Cloud
from spotcr_cli.main import main
from spotcr_cli.preflight import ON_DEMAND_VCPU_QUOTA, SPOT_VCPU_QUOTA, Target

from rehearsal import account as local_account
from rehearsal.iam import enforce, principals

REGION = "us-east-1"
ACCOUNT = "123456789012"  # moto's
# A stack's outputs, as the user's policy is written for one; preflight itself reads none of it.
OUTPUTS = {
    "CheckpointBucket": "checkpoints",
    "JobTable": "jobs",
    "LaunchTemplateId": "lt-0123456789abcdef0",
    "RecoveryStateMachineArn": f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:recovery",
}


@pytest.fixture
def world(monkeypatch):
    """An account as a user has it before deploying: the Spot role, a public and a private subnet."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("MOTO_LAMBDA_CONCURRENCY_QUOTA", raising=False)
    with mock_aws(), local_account.serve(local_account.Account()) as account:
        local_account.create_spot_role(boto3.client("iam", region_name=REGION))
        ec2 = boto3.client("ec2", region_name=REGION)
        vpc = ec2.create_vpc(CidrBlock="10.9.0.0/16")["Vpc"]["VpcId"]
        gateway = ec2.create_internet_gateway()["InternetGateway"]["InternetGatewayId"]
        ec2.attach_internet_gateway(InternetGatewayId=gateway, VpcId=vpc)
        subnets = {}
        for name, cidr in (("public", "10.9.1.0/24"), ("private", "10.9.2.0/24")):
            subnet = ec2.create_subnet(VpcId=vpc, CidrBlock=cidr)["Subnet"]["SubnetId"]
            table = ec2.create_route_table(VpcId=vpc)["RouteTable"]["RouteTableId"]
            ec2.associate_route_table(RouteTableId=table, SubnetId=subnet)
            subnets[name] = (subnet, table)
        ec2.create_route(RouteTableId=subnets["public"][1], DestinationCidrBlock="0.0.0.0/0", GatewayId=gateway)
        ec2.create_vpc_endpoint(
            VpcId=vpc,
            VpcEndpointType="Gateway",
            ServiceName=f"com.amazonaws.{REGION}.s3",
            RouteTableIds=[subnets["private"][1]],
        )
        for service in preflight.SSM_ENDPOINTS:
            ec2.create_vpc_endpoint(
                VpcId=vpc,
                VpcEndpointType="Interface",
                ServiceName=f"com.amazonaws.{REGION}.{service}",
                SubnetIds=[subnets["private"][0]],
                PrivateDnsEnabled=True,
            )
        enforcer = enforce.Enforcer(
            keys={enforce.CLI_USER_KEY: principals.cli_user(ACCOUNT, "spotcr", REGION, OUTPUTS)},
            trusted={os.environ["AWS_ACCESS_KEY_ID"]: "the test"},  # mock_aws's
            roles={},
            state=enforce.MotoState(ACCOUNT, REGION),
        )
        with enforce.enforced(enforcer):
            yield {
                "account": account,
                "ec2": ec2,
                "public": subnets["public"][0],
                "private": subnets["private"][0],
                "enforcer": enforcer,
            }


def as_user():
    """The `spotcr` command's calls, signed with its user's own key."""
    return enforce.acting_as(enforce.CLI_USER_KEY)


def spotcr(argv, out):
    with as_user():
        return main(argv, out=out)


def run(**target):
    with as_user():
        results = preflight.run_checks(Cloud(region=REGION), Target(region=target.pop("region", REGION), **target))
    return {r.name: r for r in results}


def failures(**target):
    return {name: r for name, r in run(**target).items() if not r.ok}


def test_every_check_passes_on_a_ready_account_and_the_command_exits_0(world):
    assert failures(subnets=(world["public"],), instance_types=("m5.large", "c5.xlarge")) == {}
    # A private subnet with an S3 gateway endpoint and the SSM endpoints is ready for an ebs job
    assert failures(subnets=(world["private"],), storage="ebs") == {}
    out = io.StringIO()
    assert spotcr(["--region", REGION, "preflight", "--subnets", world["public"]], out=out) == 0
    lines = out.getvalue().splitlines()
    assert [line.split()[0] for line in lines[:-1]] == ["PASS"] * len(preflight.CHECKS)
    assert lines[-1] == f"{len(preflight.CHECKS)} passed, 0 failed"


def test_a_lambda_concurrency_quota_of_10_fails_naming_the_quota_and_any_reservation_to_lower(world, monkeypatch):
    monkeypatch.setenv("MOTO_LAMBDA_CONCURRENCY_QUOTA", "10")
    check = failures()["lambda-concurrency"]
    assert check.found.startswith("10 of 10 concurrent executions unreserved")
    assert "higher 'Concurrent executions' quota" in check.fix
    assert "-c interruption_concurrency=0" in failures(reserved_concurrency=5)["lambda-concurrency"].fix
    out = io.StringIO()
    assert spotcr(["--region", REGION, "preflight"], out=out) == 1
    assert "FAIL  lambda-concurrency: 10 of 10" in out.getvalue()
    # With no reservation, a quota of 100 is enough
    monkeypatch.setenv("MOTO_LAMBDA_CONCURRENCY_QUOTA", "100")
    assert "lambda-concurrency" not in failures(reserved_concurrency=0)


def test_a_subnet_whose_route_table_lacks_the_s3_route_fails_naming_the_subnet(world):
    ec2 = world["ec2"]
    endpoint = ec2.describe_vpc_endpoints(Filters=[{"Name": "service-name", "Values": [f"com.amazonaws.{REGION}.s3"]}])
    ec2.delete_vpc_endpoints(VpcEndpointIds=[endpoint["VpcEndpoints"][0]["VpcEndpointId"]])
    failed = failures(subnets=(world["private"], world["public"]), storage="ebs")
    assert set(failed) == {"route-s3"}
    assert failed["route-s3"].found.startswith(f"no route to S3 from {world['private']} (rtb-")
    assert "--vpc-endpoint-type Gateway" in failed["route-s3"].fix


def test_a_private_subnet_fails_the_function_url_route_for_s3_jobs_and_names_the_private_path(world):
    failed = failures(subnets=(world["private"],), storage="s3")
    assert set(failed) == {"route-store-credentials"}
    assert "public-internet only" in failed["route-store-credentials"].found
    assert "-c private_subnets=true" in failed["route-store-credentials"].fix


def test_with_private_subnets_the_stack_serves_what_a_private_subnet_lacks_unless_its_endpoints_collide(world):
    # Given the private subnet, whose VPC already has the SSM endpoints with private DNS
    # When the deploy will use private_subnets, Then the function URL and the routes are the stack's to provide,
    # but its own SSM endpoints would collide with those: named, with the fix
    failed = failures(subnets=(world["private"],), storage="s3", private_subnets=True)
    assert set(failed) == {"private-endpoints"}
    assert all(f"{service} in vpc-" in failed["private-endpoints"].found for service in preflight.SSM_ENDPOINTS)
    # And once the VPC has none of them, every check passes
    ec2 = world["ec2"]
    ec2.delete_vpc_endpoints(VpcEndpointIds=[e["VpcEndpointId"] for e in ec2.describe_vpc_endpoints()["VpcEndpoints"]])
    assert failures(subnets=(world["private"],), storage="s3", private_subnets=True) == {}
    out = io.StringIO()
    argv = ["--region", REGION, "preflight", "--subnets", world["private"], "--private-subnets"]
    assert spotcr(argv, out=out) == 0, out.getvalue()


def test_a_subnet_without_ssm_endpoints_or_internet_fails_naming_the_missing_endpoints(world):
    ec2 = world["ec2"]
    ssm = ec2.describe_vpc_endpoints(Filters=[{"Name": "service-name", "Values": [f"com.amazonaws.{REGION}.ssm"]}])
    ec2.delete_vpc_endpoints(VpcEndpointIds=[ssm["VpcEndpoints"][0]["VpcEndpointId"]])
    failed = failures(subnets=(world["private"],), storage="ebs")
    assert set(failed) == {"route-ssm"}
    assert failed["route-ssm"].found.endswith(f"{world['private']} (no internet route; no ssm endpoint)")


def test_a_missing_spot_service_linked_role_fails_saying_how_to_create_it(world):
    boto3.client("iam", region_name=REGION).delete_role(RoleName=preflight.SPOT_ROLE)
    check = failures()["spot-role"]
    assert "has no AWSServiceRoleForEC2Spot" in check.found
    assert check.fix.startswith("aws iam create-service-linked-role --aws-service-name spot.amazonaws.com")


def test_a_customer_managed_default_ebs_key_passes_while_enabled_and_fails_once_disabled(world):
    # The stack's roles and the user policy hold the key's use through EC2 (infra/ebs_key.py)
    kms = boto3.client("kms", region_name=REGION)
    created = kms.create_key()["KeyMetadata"]
    key = created["Arn"]
    world["ec2"].modify_ebs_default_kms_key_id(KmsKeyId=key)
    check = run()["ebs-key"]
    assert check.ok and key in check.found and "key policy must let the account's IAM policies" in check.found
    # A disabled key creates no volume: named, with the fix
    kms.disable_key(KeyId=created["KeyId"])
    check = failures()["ebs-key"]
    assert key in check.found and "in state Disabled" in check.found
    assert "enable-key" in check.fix


def test_a_spot_vcpu_quota_below_a_primary_and_its_backup_fails(world):
    world["account"].ec2_quotas[SPOT_VCPU_QUOTA] = 4.0
    check = failures(instance_types=("m5.large", "m5.xlarge"))["vcpu-quotas"]
    assert "need 8 vCPUs" in check.found and f"spot ({SPOT_VCPU_QUOTA}) is 4" in check.found
    assert f"on-demand ({ON_DEMAND_VCPU_QUOTA})" not in check.found
    # A GPU family has its own quota: named as not checked, not counted against the standard one
    assert "not checked" in run(instance_types=("m5.large", "g5.xlarge"))["vcpu-quotas"].found


def test_a_region_without_fis_or_function_urls_fails_naming_them(world):
    # ap-southeast-3 offers no FIS (AWS's public parameters, as moto serves them); ca-west-1 has no function URLs
    assert failures(region="ap-southeast-3")["services"].found == "ap-southeast-3 does not offer fis"
    check = failures(region="ca-west-1")["function-url"]
    assert "not offered in ca-west-1" in check.found
    assert "function-url" not in failures(region="ca-west-1", storage="ebs")


def test_a_refused_call_fails_its_check_naming_the_operation(world, monkeypatch):
    from botocore.exceptions import ClientError

    def refuse(cloud, target):
        raise ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "GetRole")

    monkeypatch.setattr(preflight, "CHECKS", (refuse,))
    (check,) = preflight.run_checks(Cloud(region=REGION), Target(region=REGION))
    assert (check.ok, check.found) == (False, "AWS refused GetRole: AccessDenied: no")


def test_a_user_whose_policy_lacks_a_grant_fails_that_check_naming_the_refused_call(world):
    # Given the user's policy without lambda:GetAccountSettings
    user = principals.cli_user(ACCOUNT, "spotcr", REGION, OUTPUTS)
    world["enforcer"].add_key(enforce.CLI_USER_KEY, principals.without_grant(user, "lambda:GetAccountSettings"))
    # When preflight runs, that check fails naming the call and the action IAM refused; the others pass
    failed = failures()
    assert set(failed) == {"lambda-concurrency"}
    check = failed["lambda-concurrency"]
    assert check.found.startswith("AWS refused GetAccountSettings: AccessDeniedException: User: ")
    assert "not authorized to perform: lambda:GetAccountSettings" in check.found
    assert check.fix.startswith("let this user call GetAccountSettings")
    out = io.StringIO()
    assert spotcr(["--region", REGION, "preflight"], out=out) == 1
    assert "FAIL  lambda-concurrency: AWS refused GetAccountSettings" in out.getvalue()


def test_the_reserved_concurrency_default_is_the_stacks():
    from infra.settings import Settings

    assert Settings.interruption_concurrency == preflight.RESERVED_CONCURRENCY


def test_a_run_reads_the_subnets_and_each_vpcs_endpoints_once_however_many_checks_ask(world):
    # Given a private subnet: route-s3, route-store-credentials and route-ssm each look at its routes and endpoints
    before = len(world["enforcer"].evaluated)
    assert failures(subnets=(world["private"],), storage="ebs") == {}
    # Then the run described the subnet, its route table and its VPC's endpoints once each
    calls = [call for _, call in world["enforcer"].evaluated[before:]]
    assert calls.count("ec2:DescribeSubnets") == 1
    assert calls.count("ec2:DescribeRouteTables") == 1
    assert calls.count("ec2:DescribeVpcEndpoints") == 1
