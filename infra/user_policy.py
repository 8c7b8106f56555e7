"""The IAM policy a user needs to run the `spotcr` command against one deployed stack, and nothing more.

Every AWS call in cli/spotcr_cli has its action here (tests/localaws/test_user_policy.py scans for them), scoped
to the stack's resources as named by its CloudFormation outputs. Where a resource must be `*` or a pattern, the
statement says why. It also covers `spotcr preflight`'s read-only account checks (run before a deploy, by whoever
deploys, who may hold more) and `spotcr selftest`. Print it for a deployed stack:

    python -m infra.user_policy --stack spotcr --region eu-west-1 --account 111122223333
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from spotcr_cli import preflight
from spotcr_contracts import fis as fis_experiments
from spotcr_contracts import tags
from spotcr_functions import store_access

from infra import ebs_key

# The tags a user may write: the job's own (the tag table in docs/submitting.md) and the interruption marker. Never
# spotcr:run, which only spotcr mints (registering), nor the control plane's other tags.
USER_TAG_KEYS = (*tags.USER_TAGS, tags.INTERRUPT)
JOB_TAGGED = {"StringLike": {f"aws:ResourceTag/{tags.JOB}": "?*"}}
JOB_TAGGED_REQUEST = {"StringLike": {f"aws:RequestTag/{tags.JOB}": "?*"}}
LAUNCHED = ("volume", "network-interface", "subnet", "security-group", "spot-instances-request")
REQUIRED_OUTPUTS = ("CheckpointBucket", "JobTable", "LaunchTemplateId", "RecoveryStateMachineArn")
PROBE_PREFIX = "jobs/spotcr-probe-"  # spotcr_agent.probe.PROBE_JOB_PREFIX under jobs/: `spotcr probe --s3` here


def partition(region: str) -> str:
    """The AWS partition a region is in: what its ARNs start with (arn:<partition>:...)."""
    if region.startswith("cn-"):
        return "aws-cn"
    if region.startswith("us-gov-"):
        return "aws-us-gov"
    return "aws"


@dataclass(frozen=True)
class UserStatement:
    sid: str
    actions: tuple[str, ...]
    resources: tuple[str, ...]
    conditions: Mapping[str, Mapping[str, Any]] | None = None
    why: str = ""  # required when a resource holds a wildcard

    def document(self) -> dict[str, Any]:
        statement: dict[str, Any] = {
            "Sid": self.sid,
            "Effect": "Allow",
            "Action": list(self.actions),
            "Resource": list(self.resources),
        }
        if self.conditions:
            statement["Condition"] = {op: dict(block) for op, block in self.conditions.items()}
        return statement


def statements(stack: str, region: str, account: str, outputs: Mapping[str, str]) -> list[UserStatement]:
    """The policy's statements for a stack with these CloudFormation outputs (infra/stack.py names them)."""
    missing = [o for o in REQUIRED_OUTPUTS if not outputs.get(o)]
    if missing:
        raise ValueError(f"stack {stack} has no output {', '.join(missing)}: is it a spotcr stack, deployed?")
    arn = f"arn:{partition(region)}"
    ec2 = f"{arn}:ec2:{region}:{account}"
    bucket = f"{arn}:s3:::{outputs['CheckpointBucket']}"
    state_machine = outputs["RecoveryStateMachineArn"]
    template = f"{ec2}:launch-template/{outputs['LaunchTemplateId']}"
    # Instances launched from the stack's template: EC2 tags them with it (tags.LAUNCH_TEMPLATE), no user can.
    from_template = {"StringEquals": {f"aws:ResourceTag/{tags.LAUNCH_TEMPLATE}": outputs["LaunchTemplateId"]}}
    from_template_ssm = {"StringEquals": {f"ssm:resourceTag/{tags.LAUNCH_TEMPLATE}": outputs["LaunchTemplateId"]}}
    documents = [outputs[o] for o in ("StatusDocument", "ProbeDocument") if outputs.get(o)]
    experiment_templates = [outputs[o] for o in fis_experiments.OUTPUTS.values() if outputs.get(o)]
    fis = f"{arn}:fis:{region}:{account}"
    keys = f"{arn}:kms:{region}:{account}:key/*"
    found: list[UserStatement] = [
        UserStatement(
            "ReadStackOutputs",
            ("cloudformation:DescribeStacks",),
            (f"{arn}:cloudformation:{region}:{account}:stack/{stack}/*",),
            why="A stack's ARN ends with the id CloudFormation gives it at creation.",
        ),
        UserStatement(
            "JobRecords",
            ("dynamodb:GetItem", "dynamodb:Scan", "dynamodb:UpdateItem"),
            (f"{arn}:dynamodb:{region}:{account}:table/{outputs['JobTable']}",),
        ),
        UserStatement("ListStore", ("s3:ListBucket",), (bucket,)),
        UserStatement(
            "ReadStore",
            ("s3:GetObject",),
            (f"{bucket}/jobs/*", f"{bucket}/probes/*"),
            why="Checkpoints and logs are kept per job (jobs/<job>/), probe results per instance type (probes/).",
        ),
        UserStatement(
            "DeleteJobCheckpoints",
            ("s3:DeleteObject",),
            (f"{bucket}/jobs/*",),
            why="`spotcr cancel --delete-checkpoints` deletes any job's checkpoints (its result is kept).",
        ),
        UserStatement(
            "WriteProbes",
            ("s3:PutObject",),
            (f"{bucket}/probes/*", f"{bucket}/{PROBE_PREFIX}*"),
            why="`spotcr probe` keeps results under probes/ and measures S3 under a fresh jobs/spotcr-probe-* prefix.",
        ),
        UserStatement(
            "Describe",
            ("ec2:DescribeInstances", "ec2:DescribeVolumes", "ec2:DescribeSpotPriceHistory", "pricing:GetProducts"),
            ("*",),
            why="EC2's Describe actions and the Price List API have no resource-level permissions.",
        ),
        UserStatement("LaunchFromTheStacksTemplate", ("ec2:RunInstances",), (template,)),
        UserStatement(
            "LaunchJobInstances",
            ("ec2:RunInstances",),
            (f"{ec2}:instance/*",),
            {"ArnEquals": {"ec2:LaunchTemplate": template}, **JOB_TAGGED_REQUEST},
            why="An instance's id is made at launch; only from the stack's template and tagged with its job.",
        ),
        UserStatement(
            "LaunchWithTheTemplatesResources",
            ("ec2:RunInstances",),
            (*(f"{ec2}:{kind}/*" for kind in LAUNCHED), f"{arn}:ec2:{region}::image/*"),
            {"ArnEquals": {"ec2:LaunchTemplate": template}},
            why="RunInstances creates volumes, interfaces and a spot request with new ids, in the template's subnets "
            "and security group, from the AMI resolved at deploy; only through the stack's launch template.",
        ),
        UserStatement(
            "PassTheJobRole",
            ("iam:PassRole",),
            (f"{arn}:iam::{account}:role/{stack}-*",),
            {"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}},
            why="The job role's name is made by CloudFormation (<stack>-<id>-<suffix>) and is no stack output.",
        ),
        UserStatement(
            "TagJobInstances",
            ("ec2:CreateTags",),
            (f"{ec2}:instance/*",),
            {"ForAllValues:StringEquals": {"aws:TagKeys": list(USER_TAG_KEYS)}},
            why="A job's instance is launched or chosen (--instance) by the user; only a job's own tag keys.",
        ),
        UserStatement(
            "RemoveTheInterruptMarker",
            ("ec2:DeleteTags",),
            (f"{ec2}:instance/*",),
            {**JOB_TAGGED, "ForAllValues:StringEquals": {"aws:TagKeys": [tags.INTERRUPT]}},
            why="`spotcr interrupt` removes its marker from the job's instance, whose id is known at run time.",
        ),
        UserStatement(
            "StopJobInstances",
            ("ec2:TerminateInstances",),
            (f"{ec2}:instance/*",),
            {"StringLike": JOB_TAGGED["StringLike"], **from_template},
            why="A job's instances are known at run time; only those launched from the stack's template (EC2's "
            "aws:ec2launchtemplate:id tag, which no user writes) carrying spotcr:job.",
        ),
        UserStatement(
            "DeleteJobVolumes",
            ("ec2:DeleteVolume",),
            (f"{ec2}:volume/*",),
            JOB_TAGGED,
            why="An ebs job's checkpoint volumes are known at run time; only volumes carrying spotcr:job.",
        ),
        UserStatement("StartRecoveries", ("states:StartExecution", "states:ListExecutions"), (state_machine,)),
        UserStatement(
            "StopRecoveries",
            ("states:StopExecution",),
            (state_machine.replace(":stateMachine:", ":execution:") + ":*",),
            why="A recovery's execution is named per job and generation at run time.",
        ),
        UserStatement(
            "AskTheAgentOnAJobInstance",
            ("ssm:SendCommand",),
            (f"{ec2}:instance/*",),
            {"StringLike": {f"ssm:resourceTag/{tags.JOB}": "?*"}, **from_template_ssm},
            why="A job's instance is known at run time; only those launched from the stack's template (EC2's "
            "aws:ec2launchtemplate:id tag, which no user writes) carrying spotcr:job.",
        ),
        UserStatement(
            "ThroughTheStacksDocuments",
            ("ssm:SendCommand",),
            tuple(f"{arn}:ssm:{region}:{account}:document/{d}" for d in documents),
        ),
        UserStatement(
            "ReadTheAgentsAnswer",
            ("ssm:GetCommandInvocation",),
            ("*",),
            why="GetCommandInvocation has no resource-level permissions.",
        ),
        UserStatement(
            "UseTheEbsKeyThroughEc2",
            ebs_key.USE_ACTIONS,
            (keys,),
            ebs_key.through_ec2(region, account),
            why="Under a customer managed EBS default key, EC2 uses the key as the user who launches (infra/ebs_key.py)"
            "; which key is the account's setting. Only as EC2 in this region uses it for this account.",
        ),
        UserStatement(
            "LetEc2GrantTheEbsKeyToTheVolume",
            (ebs_key.GRANT_ACTION,),
            (keys,),
            {**ebs_key.through_ec2(region, account), **ebs_key.GRANT_FOR_AWS_RESOURCE},
            why="As UseTheEbsKeyThroughEc2; the grant only for the AWS resource EC2 creates (the volume).",
        ),
        UserStatement(
            "SelftestDeletesItsJobRecord",
            ("dynamodb:DeleteItem",),
            (f"{arn}:dynamodb:{region}:{account}:table/{outputs['JobTable']}",),
        ),
        UserStatement(
            "PreflightWhoAmI",
            ("sts:GetCallerIdentity",),
            ("*",),
            why="GetCallerIdentity needs no permission and has no resource; named so the policy lists every call.",
        ),
        UserStatement(
            "PreflightReadsTheRegionsServices",
            ("ssm:GetParametersByPath",),
            (f"{arn}:ssm:{region}::parameter{preflight.GLOBAL_INFRASTRUCTURE}/*",),
            why="AWS's public parameters naming the services each region offers.",
        ),
        UserStatement(
            "PreflightReadsTheAccountsSettings",
            (
                "lambda:GetAccountSettings",
                "ec2:DescribeInstanceTypes",
                "ec2:DescribeRouteTables",
                "ec2:DescribeSubnets",
                "ec2:DescribeVpcEndpoints",
                "ec2:GetEbsDefaultKmsKeyId",
                "ec2:GetEbsEncryptionByDefault",
            ),
            ("*",),
            why="Account settings and EC2's Describe actions have no resource-level permissions.",
        ),
        UserStatement(
            "PreflightFindsTheSpotRole",
            ("iam:GetRole",),
            (
                f"{arn}:iam::{account}:role{preflight.SPOT_ROLE_PATH}{preflight.SPOT_ROLE}",
                # A role that does not exist has no path yet: IAM then answers NoSuchEntity, which preflight explains.
                f"{arn}:iam::{account}:role/{preflight.SPOT_ROLE}",
            ),
        ),
        UserStatement(
            "PreflightReadsTheEbsDefaultKey",
            ("kms:DescribeKey",),
            (keys,),
            why="Which key is the account's EBS default is known only as preflight reads it (GetEbsDefaultKmsKeyId).",
        ),
        UserStatement(
            "PreflightReadsTheVcpuQuotas",
            ("servicequotas:GetServiceQuota",),
            tuple(
                f"{arn}:servicequotas:{region}:{account}:ec2/{code}"
                for code in (preflight.SPOT_VCPU_QUOTA, preflight.ON_DEMAND_VCPU_QUOTA)
            ),
        ),
    ]
    if experiment_templates:
        found.append(
            UserStatement(
                "InterruptThroughFis",
                ("fis:StartExperiment",),
                (*(f"{fis}:experiment-template/{t}" for t in experiment_templates), f"{fis}:experiment/*"),
                why="An experiment's id is made when it starts.",
            )
        )
        found.append(
            UserStatement(
                "SelftestReadsTheInterruptTemplates",
                ("fis:GetExperimentTemplate",),
                tuple(f"{fis}:experiment-template/{t}" for t in experiment_templates),
            )
        )
        found.append(
            UserStatement(
                "FollowTheExperiment",
                ("fis:GetExperiment", "fis:TagResource"),
                (f"{fis}:experiment/*",),
                why="An experiment's id is made when it starts (and tagged as it starts).",
            )
        )
    if outputs.get("CheckpointKeyArn"):
        found.append(
            UserStatement(
                "UseTheCheckpointKey",
                store_access.KEY_ACTIONS,
                (outputs["CheckpointKeyArn"],),
                store_access.through_s3(region, bucket),
            )
        )
    if outputs.get("EfsFileSystemId"):
        found.append(
            UserStatement(
                "DeleteJobAccessPoints",
                ("elasticfilesystem:DeleteAccessPoint",),
                (f"{arn}:elasticfilesystem:{region}:{account}:access-point/*",),
                JOB_TAGGED,
                why="An efs job's access point is made for it at run time; only those carrying spotcr:job.",
            )
        )
    found = [s for s in found if s.resources]  # a stack without documents (older outputs) gets no SendCommand on them
    for statement in found:
        if any("*" in r for r in statement.resources) and not statement.why:
            raise ValueError(f"statement {statement.sid} has a wildcard resource without a reason")
    return found


def cli_user_policy(stack: str, region: str, account: str, outputs: Mapping[str, str]) -> dict[str, Any]:
    """The `spotcr` command's least-privilege IAM policy document for this stack."""
    return {"Version": "2012-10-17", "Statement": [s.document() for s in statements(stack, region, account, outputs)]}


def stack_outputs(stack: str, region: str) -> dict[str, str]:
    """The deployed stack's outputs, as `spotcr` reads them."""
    import boto3

    found = boto3.client("cloudformation", region_name=region).describe_stacks(StackName=stack)["Stacks"][0]
    return {o["OutputKey"]: o["OutputValue"] for o in found.get("Outputs", [])}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.user_policy", description=__doc__.splitlines()[0])
    parser.add_argument("--stack", default="spotcr", help="the deployed stack's name (%(default)s)")
    parser.add_argument("--region", required=True)
    parser.add_argument("--account", required=True, help="the stack's account id")
    args = parser.parse_args(argv)
    try:
        policy = cli_user_policy(args.stack, args.region, args.account, stack_outputs(args.stack, args.region))
    except Exception as error:  # the reason, in one line, for whoever prints the policy
        print(f"python -m infra.user_policy: {error}", file=sys.stderr)
        return 1
    print(json.dumps(policy, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
