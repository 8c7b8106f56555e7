"""`spotcr preflight`: before deploying, check what a real account can refuse that a synth never sees.

Each check reads the account and returns a `Check`: PASS, or FAIL with what is wrong and how to fix it.
An AWS error inside a check fails that check, naming the call AWS refused.
"""

from __future__ import annotations

import argparse
import contextvars
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spotcr_contracts.tags import STORAGES

from spotcr_cli.aws import Cloud

# The services the stack deploys or calls, by their ids under SSM's public global-infrastructure parameters
# (https://docs.aws.amazon.com/systems-manager/latest/userguide/parameter-store-public-parameters-global-infrastructure.html).
GLOBAL_INFRASTRUCTURE = "/aws/service/global-infrastructure"
SERVICES = (
    "cloudformation", "cloudwatch", "dynamodb", "ec2", "events", "fis", "iam", "kms", "lambda", "logs", "s3",
    "sns", "sqs", "ssm", "stepfunctions", "sts",
)  # fmt: skip
STORAGE_SERVICES = {"efs": ("efs",), "fsx": ("fsx",)}
# Regions without Lambda function URLs (https://docs.aws.amazon.com/lambda/latest/dg/lambda-urls.html, 2026-11).
NO_FUNCTION_URLS = frozenset(
    {
        "ap-east-2", "ap-south-2", "ap-southeast-4", "ap-southeast-5", "ap-southeast-6", "ap-southeast-7",
        "ca-west-1", "eu-central-2", "eu-south-2", "il-central-1", "me-central-1",
    }
)  # fmt: skip
STORE_CREDENTIALS_STORAGES = ("s3", "efs")  # job VMs of these storages call the store-credentials function URL
UNRESERVED_MINIMUM = 100  # Lambda keeps this much of the account's concurrency unreserved
RESERVED_CONCURRENCY = 0  # infra/settings.py's interruption_concurrency default (a test keeps them equal)
SPOT_ROLE = "AWSServiceRoleForEC2Spot"
SPOT_ROLE_PATH = "/aws-service-role/spot.amazonaws.com/"  # where AWS keeps the Spot service-linked role
SPOT_VCPU_QUOTA = "L-34B43A08"  # All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests
ON_DEMAND_VCPU_QUOTA = "L-1216C47A"  # Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances
STANDARD_FAMILIES = frozenset("acdhimrtz")
DEFAULT_INSTANCE_TYPES = ("m5.large",)  # when the job's types are not given: a common 2-vCPU type
SSM_ENDPOINTS = ("ssm", "ssmmessages", "ec2messages")
# The interface endpoints with private DNS the stack makes with private_subnets (infra/network.py VPC_ENDPOINTS).
PRIVATE_STACK_ENDPOINTS = (*SSM_ENDPOINTS, "events", "execute-api")
PRIVATE_API = "private_subnets: store credentials come from the stack's private API through its endpoint"
PRIVATE_ENDPOINTS = "private_subnets: the stack makes the S3 gateway and the SSM endpoints"
AWS_MANAGED_EBS_KEY = "alias/aws/ebs"


@dataclass(frozen=True)
class Target:
    """What the checks need to know of the deploy and the job to come."""

    region: str
    subnets: tuple[str, ...] = ()
    instance_types: tuple[str, ...] = DEFAULT_INSTANCE_TYPES
    storage: str = "s3"
    reserved_concurrency: int = RESERVED_CONCURRENCY
    # The stack's private_subnets setting: it then makes the VPC endpoints below and serves store credentials from a
    # private API Gateway API instead of the function URL.
    private_subnets: bool = False


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    found: str
    fix: str = ""

    def line(self) -> str:
        head = f"{'PASS' if self.ok else 'FAIL'}  {self.name}: {self.found}"
        return head if self.ok else f"{head}\n      fix: {self.fix}"


def passed(name: str, found: str) -> Check:
    return Check(name, True, found)


def failed(name: str, found: str, fix: str) -> Check:
    return Check(name, False, found, fix)


def credentials(cloud: Cloud, target: Target) -> Check:
    identity = cloud.client("sts").get_caller_identity()
    return passed("credentials", f"account {identity['Account']} as {identity['Arn']}")


def services(cloud: Cloud, target: Target) -> Check:
    path = f"{GLOBAL_INFRASTRUCTURE}/regions/{target.region}/services"
    offered = set()
    for page in cloud.client("ssm").get_paginator("get_parameters_by_path").paginate(Path=path):
        offered |= {parameter["Name"].rsplit("/", 1)[-1] for parameter in page.get("Parameters", [])}
    needed = (*SERVICES, *STORAGE_SERVICES.get(target.storage, ()))
    missing = [service for service in needed if service not in offered]
    if missing:
        return failed(
            "services",
            f"{target.region} does not offer {', '.join(missing)}",
            "deploy in a region that offers every service the stack uses (--region)",
        )
    return passed("services", f"{target.region} offers all {len(needed)} services the stack uses")


def function_url(cloud: Cloud, target: Target) -> Check:
    if target.storage not in STORE_CREDENTIALS_STORAGES:
        return passed("function-url", f"{target.storage} jobs do not call the store-credentials URL")
    if target.private_subnets:
        return passed("function-url", PRIVATE_API)
    if target.region in NO_FUNCTION_URLS:
        return failed(
            "function-url",
            f"Lambda function URLs are not offered in {target.region}; {target.storage} job VMs need one",
            "deploy in another region, or use ebs storage",
        )
    return passed("function-url", f"Lambda function URLs are offered in {target.region}")


def lambda_concurrency(cloud: Cloud, target: Target) -> Check:
    limit = cloud.client("lambda").get_account_settings()["AccountLimit"]
    unreserved = int(limit["UnreservedConcurrentExecutions"])
    needed = UNRESERVED_MINIMUM + target.reserved_concurrency
    found = (
        f"{unreserved} of {limit['ConcurrentExecutions']} concurrent executions unreserved; the stack reserves "
        f"{target.reserved_concurrency} and Lambda keeps {UNRESERVED_MINIMUM} unreserved"
    )
    if unreserved < needed:
        reserve = (
            f"deploy with -c interruption_concurrency={max(0, unreserved - UNRESERVED_MINIMUM)} (0 reserves none), or "
            if target.reserved_concurrency
            else "a wave of interruptions runs several functions per job at once: "
        )
        return failed(
            "lambda-concurrency",
            found,
            f"{reserve}ask for a higher 'Concurrent executions' quota (Service Quotas, AWS Lambda)",
        )
    return passed("lambda-concurrency", found)


def spot_role(cloud: Cloud, target: Target) -> Check:
    iam = cloud.client("iam")
    try:
        arn = iam.get_role(RoleName=SPOT_ROLE)["Role"]["Arn"]
    except iam.exceptions.NoSuchEntityException:
        return failed(
            "spot-role",
            f"the account has no {SPOT_ROLE}: spot launches fail without it",
            "aws iam create-service-linked-role --aws-service-name spot.amazonaws.com "
            "(or deploy as a principal allowed iam:CreateServiceLinkedRole: the stack creates it)",
        )
    return passed("spot-role", arn)


def ebs_key(cloud: Cloud, target: Target) -> Check:
    ec2 = cloud.client("ec2")
    by_default = ec2.get_ebs_encryption_by_default()["EbsEncryptionByDefault"]
    key = ec2.get_ebs_default_kms_key_id()["KmsKeyId"]
    found = f"encryption by default {'on' if by_default else 'off'}; default key {key}"
    if key == AWS_MANAGED_EBS_KEY:
        return passed("ebs-key", f"{found} (AWS managed)")
    metadata = cloud.client("kms").describe_key(KeyId=key)["KeyMetadata"]
    if metadata.get("KeyManager") == "AWS":
        return passed("ebs-key", f"{found} (AWS managed)")
    if metadata.get("KeyState") != "Enabled":
        return failed(
            "ebs-key",
            f"{found}, a customer managed key in state {metadata.get('KeyState')}: EC2 can create no volume with it",
            "enable the key (aws kms enable-key), or aws ec2 reset-ebs-default-kms-key-id (back to aws/ebs)",
        )
    # The stack's roles and the user policy hold its use through EC2 (kms:ViaService); the key's policy decides too.
    return passed(
        "ebs-key",
        f"{found}, a customer managed key: spotcr's roles use it through EC2; its key policy must let the account's "
        "IAM policies grant it (the default key policy does)",
    )


@dataclass(frozen=True)
class _Subnet:
    subnet_id: str
    vpc_id: str
    routes: tuple[dict[str, Any], ...]
    route_table: str


# What a run of the checks read of the VPC (subnets, route tables, endpoints): several checks ask the same.
_READ: contextvars.ContextVar[dict[tuple[str, ...], Any] | None] = contextvars.ContextVar(
    "preflight_read", default=None
)


def _once(key: tuple[str, ...], read: Callable[[], Any]) -> Any:
    """`read()`, done once per run of the checks (every time outside one)."""
    memo = _READ.get()
    if memo is None:
        return read()
    if key not in memo:
        memo[key] = read()
    return memo[key]


def _subnets(cloud: Cloud, target: Target) -> list[_Subnet]:
    return list(_once(("subnets", *target.subnets), lambda: _read_subnets(cloud, target)))


def _read_subnets(cloud: Cloud, target: Target) -> list[_Subnet]:
    ec2 = cloud.client("ec2")
    found = []
    for subnet in ec2.describe_subnets(SubnetIds=list(target.subnets))["Subnets"]:
        subnet_id, vpc_id = subnet["SubnetId"], subnet["VpcId"]
        tables = ec2.describe_route_tables(Filters=[{"Name": "association.subnet-id", "Values": [subnet_id]}])
        if not tables["RouteTables"]:  # no explicit association: the VPC's main route table
            main = [{"Name": "vpc-id", "Values": [vpc_id]}, {"Name": "association.main", "Values": ["true"]}]
            tables = ec2.describe_route_tables(Filters=main)
        table = tables["RouteTables"][0]
        found.append(_Subnet(subnet_id, vpc_id, tuple(table.get("Routes", [])), table["RouteTableId"]))
    return found


def _internet(subnet: _Subnet) -> str | None:
    """The subnet's default route to the internet: an internet gateway or a NAT gateway."""
    for route in subnet.routes:
        default = route.get("DestinationCidrBlock") == "0.0.0.0/0" and route.get("State", "active") == "active"
        via = route.get("NatGatewayId") or route.get("GatewayId", "")
        if default and (via.startswith("igw-") or via.startswith("nat-")):
            return via
    return None


def _endpoints(cloud: Cloud, vpc_id: str, region: str, service: str) -> list[dict[str, Any]]:
    """The VPC's available endpoints for the service (the VPC's endpoints read once per run)."""
    name = f"com.amazonaws.{region}.{service}"
    found = _once(("endpoints", vpc_id), lambda: _read_endpoints(cloud, vpc_id))
    return [e for e in found if e.get("ServiceName") == name and e.get("State", "available").lower() == "available"]


def _read_endpoints(cloud: Cloud, vpc_id: str) -> list[dict[str, Any]]:
    paginator = cloud.client("ec2").get_paginator("describe_vpc_endpoints")
    pages = paginator.paginate(Filters=[{"Name": "vpc-id", "Values": [vpc_id]}])
    return [endpoint for page in pages for endpoint in page["VpcEndpoints"]]


def _own_vpc(name: str, target: Target) -> Check | None:
    if target.subnets:
        return None
    return passed(name, "no --subnets: the stack makes its own VPC whose public subnets route to the internet")


def route_s3(cloud: Cloud, target: Target) -> Check:
    if (own := _own_vpc("route-s3", target)) is not None:
        return own
    if target.private_subnets:
        return passed("route-s3", PRIVATE_ENDPOINTS)
    missing = []
    for subnet in _subnets(cloud, target):
        gateways = _endpoints(cloud, subnet.vpc_id, target.region, "s3")
        through_endpoint = any(subnet.route_table in e.get("RouteTableIds", []) for e in gateways)
        if not through_endpoint and _internet(subnet) is None:
            missing.append(f"{subnet.subnet_id} ({subnet.route_table})")
    if missing:
        return failed(
            "route-s3",
            f"no route to S3 from {', '.join(missing)}: no S3 gateway endpoint on its route table, "
            "no internet or NAT gateway default route",
            "add an S3 gateway endpoint to that route table (aws ec2 create-vpc-endpoint --vpc-endpoint-type "
            f"Gateway --service-name com.amazonaws.{target.region}.s3 --route-table-ids ...), or a NAT gateway",
        )
    return passed("route-s3", f"{len(target.subnets)} subnet(s) reach S3")


def route_store_credentials(cloud: Cloud, target: Target) -> Check:
    name = "route-store-credentials"
    if target.storage not in STORE_CREDENTIALS_STORAGES:
        return passed(name, f"{target.storage} jobs do not call the store-credentials URL")
    if (own := _own_vpc(name, target)) is not None:
        return own
    if target.private_subnets:
        return passed(name, PRIVATE_API)
    missing = [s for s in _subnets(cloud, target) if _internet(s) is None]
    if missing:
        return failed(
            name,
            f"{', '.join(s.subnet_id for s in missing)} have no internet or NAT gateway route, and the "
            f"store-credentials function URL is public-internet only (no PrivateLink); {target.storage} jobs there "
            "cannot start",
            "add a NAT gateway default route, or deploy with -c private_subnets=true: the stack then serves "
            "store credentials from a private API Gateway API through a VPC endpoint",
        )
    return passed(name, f"{len(target.subnets)} subnet(s) reach the internet for the function URL")


def route_ssm(cloud: Cloud, target: Target) -> Check:
    if (own := _own_vpc("route-ssm", target)) is not None:
        return own
    if target.private_subnets:
        return passed("route-ssm", PRIVATE_ENDPOINTS)
    missing = []
    for subnet in _subnets(cloud, target):
        if _internet(subnet) is not None:
            continue
        absent = [
            service
            for service in SSM_ENDPOINTS
            if not any(e.get("PrivateDnsEnabled") for e in _endpoints(cloud, subnet.vpc_id, target.region, service))
        ]
        if absent:
            missing.append(f"{subnet.subnet_id} (no internet route; no {', '.join(absent)} endpoint)")
    if missing:
        return failed(
            "route-ssm",
            f"the SSM Agent cannot reach SSM from {'; '.join(missing)}",
            "add interface endpoints with private DNS for "
            + ", ".join(f"com.amazonaws.{target.region}.{s}" for s in SSM_ENDPOINTS)
            + " in the VPC, or a NAT gateway",
        )
    return passed("route-ssm", f"{len(target.subnets)} subnet(s) reach SSM")


def private_endpoints(cloud: Cloud, target: Target) -> Check:
    """A VPC holds one interface endpoint with private DNS per service: the stack's own would collide."""
    if not target.private_subnets or not target.subnets:
        return passed("private-endpoints", "the stack makes no endpoint in a VPC of yours")
    vpcs = sorted({subnet.vpc_id for subnet in _subnets(cloud, target)})
    taken = [
        f"{service} in {vpc}"
        for vpc in vpcs
        for service in PRIVATE_STACK_ENDPOINTS
        if any(e.get("PrivateDnsEnabled") for e in _endpoints(cloud, vpc, target.region, service))
    ]
    if taken:
        return failed(
            "private-endpoints",
            f"the VPC already has interface endpoints with private DNS for {', '.join(taken)}; with private_subnets "
            "the stack makes its own, and a VPC takes one with private DNS per service",
            "deploy private_subnets into a VPC without them, or leave private_subnets off (the existing endpoints "
            "then serve SSM; store credentials need a route to the internet for the function URL)",
        )
    return passed("private-endpoints", f"no endpoint in {', '.join(vpcs)} collides with the stack's")


def vcpu_quotas(cloud: Cloud, target: Target) -> Check:
    """A recovery runs the primary and its backup at once: the job needs twice its largest type's vCPUs."""
    standard = [t for t in target.instance_types if t.split(".", 1)[0][:1] in STANDARD_FAMILIES]
    others = sorted(set(target.instance_types) - set(standard))
    note = f"; not checked (their families have their own quotas): {', '.join(others)}" if others else ""
    if not standard:
        return passed("vcpu-quotas", f"no standard-family type among {', '.join(target.instance_types)}{note}")
    described = cloud.client("ec2").describe_instance_types(InstanceTypes=standard)["InstanceTypes"]
    needed = 2 * max(int(t["VCpuInfo"]["DefaultVCpus"]) for t in described)
    quotas = cloud.client("service-quotas")
    short = []
    values = []
    for code, market in ((SPOT_VCPU_QUOTA, "spot"), (ON_DEMAND_VCPU_QUOTA, "on-demand")):
        value = float(quotas.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"])
        values.append(f"{market} {value:g}")
        if value < needed:
            short.append(f"{market} ({code}) is {value:g}")
    found = f"{', '.join(standard)} need {needed} vCPUs (primary and backup at once); quotas {', '.join(values)}"
    if short:
        return failed(
            "vcpu-quotas",
            f"{found}: {'; '.join(short)}{note}",
            f"ask for at least {needed} vCPUs in Service Quotas (Amazon EC2, the codes above), or use smaller types",
        )
    return passed("vcpu-quotas", found + note)


CHECKS: tuple[Callable[[Cloud, Target], Check], ...] = (
    credentials,
    services,
    function_url,
    lambda_concurrency,
    spot_role,
    ebs_key,
    route_s3,
    route_store_credentials,
    route_ssm,
    private_endpoints,
    vcpu_quotas,
)


def run_checks(cloud: Cloud, target: Target) -> list[Check]:
    read = _READ.set({})
    try:
        return [_run(check, cloud, target) for check in CHECKS]
    finally:
        _READ.reset(read)


def _run(check: Callable[[Cloud, Target], Check], cloud: Cloud, target: Target) -> Check:
    """The check's result; an AWS error fails it, naming the call AWS refused."""
    from botocore.exceptions import BotoCoreError, ClientError

    name = check.__name__.replace("_", "-")
    try:
        return check(cloud, target)
    except ClientError as error:
        operation = error.operation_name
        code = error.response.get("Error", {}).get("Code", "")
        return failed(
            name,
            f"AWS refused {operation}: {code}: {error.response.get('Error', {}).get('Message', '')}",
            f"let this user call {operation} (python -m infra.user_policy prints the policy), then rerun preflight",
        )
    except BotoCoreError as error:
        return failed(name, f"{type(error).__name__}: {error}", "aws configure, or set AWS_PROFILE")


def region_of(cloud: Cloud) -> str:
    region = cloud.client("sts").meta.region_name
    if not region:
        from spotcr_cli.aws import CommandError

        raise CommandError("no region: give --region or set AWS_REGION", 2)
    return str(region)


def register(commands: Any) -> None:
    parser = commands.add_parser("preflight", help="before deploying: check the account, region and subnets")
    parser.add_argument("--subnets", default="", help="the subnet ids you deploy into, comma-separated")
    parser.add_argument(
        "--instance-types",
        default=",".join(DEFAULT_INSTANCE_TYPES),
        help="the job's instance types, comma-separated (default %(default)s)",
    )
    parser.add_argument("--storage", choices=STORAGES, default="s3", help="where checkpoints go (default s3)")
    parser.add_argument(
        "--reserved-concurrency",
        type=int,
        default=RESERVED_CONCURRENCY,
        help="the stack's interruption_concurrency setting (default %(default)s)",
    )
    parser.add_argument(
        "--private-subnets",
        action="store_true",
        help="you will deploy with -c private_subnets=true (the stack makes the VPC endpoints and a private API)",
    )
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=cmd_preflight)


def _items(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def cmd_preflight(args: argparse.Namespace) -> int:
    from spotcr_cli import render

    target = Target(
        region=region_of(args.cloud),
        subnets=_items(args.subnets),
        instance_types=_items(args.instance_types) or DEFAULT_INSTANCE_TYPES,
        storage=args.storage,
        reserved_concurrency=args.reserved_concurrency,
        private_subnets=args.private_subnets,
    )
    results = run_checks(args.cloud, target)
    if args.json:
        render.as_json([r.__dict__ for r in results], args.out)
    else:
        for result in results:
            print(result.line(), file=args.out)
        failures = sum(not r.ok for r in results)
        print(f"{len(results) - failures} passed, {failures} failed", file=args.out)
    return 0 if all(r.ok for r in results) else 1
