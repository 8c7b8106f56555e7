"""The EC2 Spot service-linked role: spot launches of backups need AWSServiceRoleForEC2Spot in the account.

Created at deploy time if the account lacks it, then read back, so a deploy fails with a clear error when it
cannot exist, instead of every spot backup failing later with AuthFailure.ServiceLinkedRoleCreationNotPermitted.
"""

from __future__ import annotations

from aws_cdk import Aws, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import custom_resources as cr
from constructs import Construct

from infra.nag import acknowledge

ROLE_NAME = "AWSServiceRoleForEC2Spot"
SERVICE = "spot.amazonaws.com"
PROVIDER_ID = "AWS679f53fac002430cb0da5b7982bd2287"  # the stack-wide function CDK shares among AwsCustomResources


class SpotServiceLinkedRole(Construct):
    def __init__(self, scope: Construct, construct_id: str) -> None:
        super().__init__(scope, construct_id)
        role_arn = f"arn:{Aws.PARTITION}:iam::{Aws.ACCOUNT_ID}:role/aws-service-role/{SERVICE}/{ROLE_NAME}"
        physical_id = cr.PhysicalResourceId.of(ROLE_NAME)
        # IAM answers InvalidInput ("has been taken in this account") when the role exists already: that is success.
        create = cr.AwsSdkCall(
            service="IAM",
            action="createServiceLinkedRole",
            parameters={"AWSServiceName": SERVICE},
            physical_resource_id=physical_id,
            ignore_error_codes_matching="InvalidInput",
        )
        self.created = cr.AwsCustomResource(
            self,
            "Create",
            on_create=create,
            on_update=create,
            install_latest_aws_sdk=False,
            policy=cr.AwsCustomResourcePolicy.from_statements(
                [
                    iam.PolicyStatement(
                        actions=["iam:CreateServiceLinkedRole"],
                        resources=[role_arn],
                        conditions={"StringEquals": {"iam:AWSServiceName": SERVICE}},
                    )
                ]
            ),
        )
        check = cr.AwsSdkCall(
            service="IAM", action="getRole", parameters={"RoleName": ROLE_NAME}, physical_resource_id=physical_id
        )
        self.checked = cr.AwsCustomResource(
            self,
            "Check",
            on_create=check,
            on_update=check,
            install_latest_aws_sdk=False,
            policy=cr.AwsCustomResourcePolicy.from_statements(
                [iam.PolicyStatement(actions=["iam:GetRole"], resources=[role_arn])]
            ),
        )
        self.checked.node.add_dependency(self.created)
        provider = Stack.of(self).node.try_find_child(PROVIDER_ID)
        if provider is not None:
            acknowledge(
                provider,
                "AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AWSLambdaBasicExecutionRole]",
                "CDK's AwsCustomResource provider (run once per deploy) writes its own logs with the AWS basic "
                "execution policy; it holds nothing else but the two IAM calls above.",
            )
